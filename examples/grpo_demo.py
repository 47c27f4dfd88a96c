"""A complete GRPO loop on tide's built-in demo model, on CPU, in a few minutes.

Each step:
1. rollouts: `n` samples per prompt from the tide engine (temperature 1, a seed per sample, logprobs
   returned); every rollout's `weight_version` is checked against the weights the trainer last sent;
2. a verifiable reward: the fraction of completion tokens that spell the target word (default
   " the"), so it can be checked by reading the text;
3. group-relative advantages (reward minus its prompt group's mean, over the group's std);
4. a clipped policy-gradient (PPO/GRPO) update of the trainer's transformers model in PyTorch; the
   importance ratio's denominator is the rollout's own logprob, and `tide.rl.logprobs` recomputes it
   on the trainer side to show it is the same number (0 difference with deterministic inference);
5. `pause_generation("in_place")` -> `update_weights_from_tensor(flattened bucket)` ->
   `continue_generation()`, with a new weight version.

Printed per step: mean reward, max |trainer logprob - rollout logprob|, update time, and the engine's
memory ledger totals (release points by reason).

    python examples/grpo_demo.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

import tide
import tide.rl
from tide.config import DEMO_MODEL_PATH
from tide.weights import FlattenedBucket

PROMPTS = [
    "A list is",
    "The function returns",
    "In Python, a dictionary",
    "To open a file,",
]


@dataclass
class Rollout:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    reward: float
    group: int


@dataclass
class StepStats:
    step: int
    mean_reward: float
    max_logprob_diff: float
    update_s: float
    ledger: dict[str, dict[str, float]]  # release totals by reason
    marks: dict[str, int]  # lifecycle marks by kind (pause, weight update, continue...)


def reward(text_tokens: list[str], target: str) -> float:
    """Fraction of the completion's tokens equal to `target` (0 for an empty completion)."""
    if not text_tokens:
        return 0.0
    return sum(t == target for t in text_tokens) / len(text_tokens)


def rollouts(engine: tide.Engine, prompts: list[list[int]], n: int, max_new: int, step: int,
             version: str, target: str) -> list[Rollout]:
    items, params, groups = [], [], []
    for g, ids in enumerate(prompts):
        for i in range(n):
            items.append(ids)
            params.append({"max_new_tokens": max_new, "temperature": 1.0,
                           "seed": 1_000_000 * step + 1000 * g + i})
            groups.append(g)
    outs = engine.generate(input_ids=items, sampling_params=params, return_logprob=True)
    assert isinstance(outs, list)
    tok = engine.tokenizer
    result = []
    for ids, out, g in zip(items, outs, groups):
        got = out["meta_info"]["weight_version"]
        if got != version:
            raise RuntimeError(f"rollout generated with weight_version {got!r}, expected {version!r}")
        pieces = [tok.decode([t]) for t in out["output_ids"]]
        lps = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
        result.append(Rollout(ids, out["output_ids"], lps, reward(pieces, target), g))
    return result


def advantages(batch: list[Rollout]) -> list[float]:
    by_group: dict[int, list[float]] = {}
    for r in batch:
        by_group.setdefault(r.group, []).append(r.reward)
    out = []
    for r in batch:
        rs = torch.tensor(by_group[r.group])
        out.append(float((r.reward - rs.mean()) / (rs.std(unbiased=False) + 1e-4)))
    return out


def policy_loss(model: torch.nn.Module, batch: list[Rollout], adv: list[float],
                clip: float) -> torch.Tensor:
    """Clipped surrogate, token-mean per sequence, mean over sequences."""
    losses = []
    for r, a in zip(batch, adv):
        if not r.output_ids or a == 0.0:
            continue
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(
            1, torch.tensor(r.output_ids).unsqueeze(1)).squeeze(1)
        ratio = torch.exp(logp - torch.tensor(r.logprobs))
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        losses.append(-surrogate.mean())
    if not losses:
        return torch.zeros((), requires_grad=True)
    return torch.stack(losses).mean()


def push_weights(engine: tide.Engine, model: torch.nn.Module, version: str) -> float:
    """pause in place -> one flattened bucket -> continue; returns the seconds it took."""
    start = time.perf_counter()
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    bucket = FlattenedBucket.from_named_tensors(named)
    engine.pause_generation("in_place")
    reply = engine.update_weights_from_tensor(bucket, load_format="flattened_bucket",
                                              weight_version=version)
    engine.continue_generation()
    if not reply["success"]:
        raise RuntimeError(f"weight update failed: {reply['message']}")
    return time.perf_counter() - start


def run(steps: int = 8, n: int = 8, max_new: int = 12, lr: float = 3e-4, seed: int = 0,
        target: str = " the", deterministic: bool = True, clip: float = 0.2,
        log: bool = True) -> list[StepStats]:
    """Run the loop; returns the per-step figures (the CI test reads them)."""
    import transformers

    torch.manual_seed(seed)
    engine = tide.Engine(enable_deterministic_inference=deterministic, seed=seed)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH,
                                                                dtype=torch.float32)
    opt = torch.optim.Adam(trainer.parameters(), lr=lr)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    version = "step-0"
    stats: list[StepStats] = []
    try:
        # The engine starts from the same checkpoint; tag it with the trainer's version.
        push_weights(engine, trainer, version)
        for step in range(steps):
            trainer.eval()
            batch = rollouts(engine, prompts, n, max_new, step, version, target)
            diff = 0.0
            for r in batch:
                ref = tide.rl.logprobs(trainer, r.prompt_ids, r.output_ids)
                diff = max([diff] + [abs(a - b) for a, b in zip(ref, r.logprobs)])
            adv = advantages(batch)
            trainer.train()
            loss = policy_loss(trainer, batch, adv, clip)
            opt.zero_grad()
            loss.backward()
            opt.step()
            version = f"step-{step + 1}"
            update_s = push_weights(engine, trainer, version)
            s = StepStats(step, sum(r.reward for r in batch) / len(batch), diff, update_s,
                          engine.memory_ledger.totals(), engine.memory_ledger.mark_counts())
            stats.append(s)
            if log:
                print(f"step {step:3d}  mean reward {s.mean_reward:.4f}  "
                      f"max |trainer - rollout logprob| {s.max_logprob_diff:.3g}  "
                      f"update {s.update_s * 1e3:.1f} ms  ledger releases {json.dumps(s.ledger)} "
                      f"marks {json.dumps(s.marks)}",
                      flush=True)
    finally:
        engine.shutdown()
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=" the", help="the token the reward counts")
    p.add_argument("--no-deterministic", action="store_true",
                   help="run the engine without enable_deterministic_inference")
    args = p.parse_args()
    run(args.steps, args.n, args.max_new_tokens, args.lr, args.seed, args.target,
        not args.no_deterministic)


if __name__ == "__main__":
    main()
