"""HTTP serving: `tide serve` (OpenAI + sglang-native routes) in front of a scheduler process."""

from tide.server.server_args import ServerArgs


def launch_server(args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM; see `tide.server.launch`."""
    from tide.server.launch import launch_server as _launch

    return _launch(args)


__all__ = ["ServerArgs", "launch_server"]
