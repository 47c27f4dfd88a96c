"""Many engines: a data-parallel router (`router`), the `tide serve --dp-size N` controller
(`dp_controller`) and engine replicas on Ray (`ray`, needs `pip install 'tide[ray]'`)."""
