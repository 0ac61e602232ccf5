"""Throughput and latency figures of the offline PyTRIO backend's engine (one run; prints a small table).

The engine is measured in-process (``connect("offline", in_process=True)``), without pytrio's client; the import
row measures what a reader's first ``connect("offline")`` costs (the loopback server and pytrio's client included).

Usage::

    python benchmarks/bench_offline.py                        # offline/tiny, the defaults below
    python benchmarks/bench_offline.py --model Qwen/Qwen3.5-4B  # a fitted offline model

Measured:

- sampling tokens/s: ``--prompts`` chat prompts x ``--samples`` samples x ``--max-tokens`` tokens, all requests
  submitted before any is awaited. Every sequence is forced to ``--max-tokens`` tokens: no stop strings, and (unless
  ``--allow-eos``) the end-of-turn tokens that always stop a sequence on the service are switched off *for this
  benchmark only*, so the workload is the same whatever the model;
- forward_backward tokens/s on the resulting datums (``importance_sampling``, group-centred toy advantages);
- a GRPO-shaped step at latency 0: refresh the sampler, sample the group, forward_backward, then (once it
  succeeded, the order of ``trio_helpers.rl.train_on_groups``) optim_step;
- ``import trio_helpers`` and ``import trio_helpers; connect("offline")`` times, each in a fresh subprocess;
- 8 sequential sync requests vs 8 concurrent ``sample_async`` requests at ``--latency`` seconds.

Not a test: nothing is asserted. Wall-clock figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many in all?",
    "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting. How much did she earn?",
    "Betty needs $100 for a wallet. She has half of the money. How much more does she need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Josh buys a house for $80,000 and puts in $50,000 in repairs. How much is the house worth now?",
    "Every day, Wendi feeds each of her chickens three cups of mixed chicken feed. How many cups in a week?",
    "Kylar went to the store to buy glasses. One glass costs $5. How much does he pay for 16 glasses?",
]


def _subprocess_seconds(code: str) -> tuple[float, float]:
    """(seconds measured inside a fresh interpreter, wall seconds of the whole subprocess)."""
    script = f"import time\nt0 = time.perf_counter()\n{code}\nprint(time.perf_counter() - t0)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    return float(out.stdout.strip().splitlines()[-1]), wall


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _sample_group(trio, sampler, prompts, samples, max_tokens, seed):
    """Submit every prompt's request first, then wait for all of them (how an RL loop overlaps requests)."""
    futures = [
        sampler.sample(
            trio.ModelInput.from_ints(p),
            num_samples=samples,
            sampling_params=trio.SamplingParams(max_tokens=max_tokens, seed=seed + i, temperature=1.0),
        )
        for i, p in enumerate(prompts)
    ]
    return [f.result() for f in futures]


def _datums(trio, prompts, results):
    data = []
    for prompt, res in zip(prompts, results):
        rewards = [sum(ch.isdigit() for ch in (s.text or "")) / max(len(s.tokens), 1) for s in res.sequences]
        mean = sum(rewards) / len(rewards)
        for seq, r in zip(res.sequences, rewards):
            pad = len(prompt) - 1
            data.append(
                trio.Datum(
                    model_input=trio.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [0] * pad + seq.tokens,
                        "logprobs": [0.0] * pad + seq.logprobs,
                        "advantages": [0.0] * pad + [float(r - mean)] * len(seq.tokens),
                    },
                )
            )
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="offline/tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="GRPO-shaped steps to time")
    ap.add_argument("--latency", type=float, default=0.2, help="simulated latency for the sync-vs-async figure")
    ap.add_argument("--allow-eos", action="store_true", help="let end-of-turn tokens stop sequences early")
    ap.add_argument(
        "--home",
        default=None,
        help="offline home for checkpoints (default: $TRIO_OFFLINE_HOME or ~/.cache/trio_helpers); the benchmark "
        "writes none. Fitted base models are cached under $TRIO_OFFLINE_CACHE.",
    )
    args = ap.parse_args(argv)

    import pytrio as trio

    from trio_helpers import connect
    from trio_helpers.offline import service as offline_service

    if not args.allow_eos:
        # benchmark only: no implicit stop ids, so every sequence is exactly --max-tokens long
        offline_service._stop_spec = lambda stop: (frozenset(), ())

    home = {"home": args.home} if args.home else {}
    rows: list[tuple[str, str]] = []

    t0 = time.perf_counter()
    svc = connect("offline", latency=0.0, in_process=True, **home)  # the engine, without pytrio's client
    tc = svc.create_lora_training_client(args.model, rank=32, seed=0)
    rows.append(("model load + training client", f"{time.perf_counter() - t0:.2f} s  ({args.model})"))
    tokenizer = tc.get_tokenizer()
    prompts = _prompts(tokenizer, args.prompts)
    sampler = tc.save_weights_and_get_sampling_client()
    _sample_group(trio, sampler, prompts[:1], 1, 4, seed=0)  # warm-up

    t0 = time.perf_counter()
    results = _sample_group(trio, sampler, prompts, args.samples, args.max_tokens, seed=1)
    dt = time.perf_counter() - t0
    gen = sum(r.output_tokens for r in results)
    n_seq = sum(len(r.sequences) for r in results)
    rows.append(
        (
            f"sample {args.prompts}x{args.samples}x{args.max_tokens}",
            f"{gen / dt:,.0f} tok/s  ({gen} tokens, {n_seq} seqs, mean len {gen / n_seq:.0f}, {dt:.2f} s)",
        )
    )

    data = _datums(trio, prompts, results)
    n_tok = sum(len(d.model_input) for d in data)
    t0 = time.perf_counter()
    tc.forward_backward(data, loss_fn="importance_sampling").result()
    dt = time.perf_counter() - t0
    rows.append((f"forward_backward {len(data)} datums", f"{n_tok / dt:,.0f} tok/s  ({n_tok} tokens, {dt:.2f} s)"))
    tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()
        results = _sample_group(trio, sampler, prompts, args.samples, args.max_tokens, seed=100 * (step + 2))
        data = _datums(trio, prompts, results)
        # the loop's order (trio_helpers.rl.train_on_groups): optim_step only once forward_backward succeeded
        tc.forward_backward(data, loss_fn="importance_sampling").result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
        times.append(time.perf_counter() - t0)
    rows.append(
        (
            "GRPO-shaped step (latency 0)",
            f"{min(times):.2f} s min / {sum(times) / len(times):.2f} s mean over {len(times)} steps",
        )
    )

    inner, wall = _subprocess_seconds("import trio_helpers")
    rows.append(("import trio_helpers", f"{inner * 1000:.0f} ms  (subprocess wall {wall:.2f} s)"))
    inner, wall = _subprocess_seconds("import trio_helpers\ntrio_helpers.connect('offline')")
    rows.append(("import + connect('offline')", f"{inner * 1000:.0f} ms  (subprocess wall {wall:.2f} s)"))

    slow = connect("offline", latency=args.latency, in_process=True, **home)
    lat_sampler = slow.create_sampling_client(args.model)
    prompt = trio.ModelInput.from_ints(prompts[0])
    sp = trio.SamplingParams(max_tokens=16, seed=0)
    lat_sampler.sample(prompt, sampling_params=sp).result()  # warm-up
    t0 = time.perf_counter()
    for _ in range(8):
        lat_sampler.sample(prompt, sampling_params=sp).result()
    t_sync = time.perf_counter() - t0

    async def concurrent():
        await asyncio.gather(*[lat_sampler.sample_async(prompt, sampling_params=sp) for _ in range(8)])

    t0 = time.perf_counter()
    asyncio.run(concurrent())
    t_async = time.perf_counter() - t0
    rows.append(
        (
            f"8 requests at latency {args.latency:g} s",
            f"sync {t_sync:.2f} s, async {t_async:.2f} s, ratio {t_sync / t_async:.1f}x",
        )
    )

    width = max(len(k) for k, _ in rows)
    print(f"offline backend benchmark  (python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    print("-" * (width + 50))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
