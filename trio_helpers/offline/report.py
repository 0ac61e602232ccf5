"""Report on the offline models: do they make learning real and visible? (``python -m trio_helpers.offline.report``)

From one seeded run it prints, with the wall time of each phase:

- student and teacher pass@1 at temperature 1 on the offline train split, greedy accuracy on the test split, and
  their cross-entropy per token on the corpus' solutions;
- a 30-step GRPO run of the student (8 prompts x 4 samples, importance_sampling, Adam lr 4e-5, betas 0.9/0.95):
  mean reward of the first 5 and the last 5 steps;
- a 30-step on-policy distillation run (same sizes and learning rate): the student's exact mean per-token reverse
  KL to the teacher on a fixed set of 32 held-out prompts, before and after.

Everything goes through the public PyTRIO API of the offline backend (``connect("offline")``): the loops below are
ordinary client code. The backend itself never sees a reward: rewards are computed here, turned into advantages,
and reach the model only through ``forward_backward`` + ``optim_step``.

It exits with status 1 when a target of the offline backend's design is missed (see ``TARGETS``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

TARGETS = {
    "student pass@1 (train, T=1) in [0.15, 0.8]": lambda r: 0.15 <= r["student_pass1"] <= 0.8,
    "teacher pass@1 > student pass@1": lambda r: r["teacher_pass1"] > r["student_pass1"],
    "teacher loss/token < student loss/token": lambda r: r["teacher_loss"] < r["student_loss"],
    "GRPO: last-5 mean reward >= first-5 + 0.1": lambda r: r["grpo_last5"] >= r["grpo_first5"] + 0.1,
    "OPD: held-out reverse KL down >= 20%": lambda r: r["opd_kl_after"] <= 0.8 * r["opd_kl_before"],
}

STUDENT, TEACHER = "Qwen/Qwen3.5-4B", "Qwen/Qwen3.6-27B"


def _setup():
    import pytrio as trio

    from trio_helpers import connect
    from trio_helpers.data import load_deepmath, load_gsm8k

    svc = connect("offline", latency=0.0)
    return trio, svc, load_gsm8k("train", source="offline"), load_gsm8k("test", source="offline"), \
        load_deepmath(source="offline", sample_size=0)


def _prompt(tok, question, kind="gsm8k"):
    from trio_helpers.prompts import build_prompt, deepmath_messages, gsm8k_messages

    msgs = gsm8k_messages(question) if kind == "gsm8k" else deepmath_messages(question)
    return build_prompt(tok, msgs)


def pass_at_1(trio, sampler, tok, records, n_problems, samples, temperature, seed, max_tokens=256):
    from trio_helpers.grading import extract_gsm8k_answer, grade_answer

    futures = []
    for i, rec in enumerate(records[:n_problems]):
        sp = trio.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        futures.append((rec, sampler.sample(_prompt(tok, rec["question"]), num_samples=samples, sampling_params=sp)))
    scores = [
        grade_answer(s.text, extract_gsm8k_answer(rec["answer"]))
        for rec, fut in futures
        for s in fut.result().sequences
    ]
    return float(np.mean(scores))


def corpus_loss(trio, training_client, tok, records, n):
    """Cross-entropy per token of the model on the corpus' worked solutions (boxed style), via forward()."""
    from trio_helpers.offline.corpus import render_solution

    data = []
    for rec in records[:n]:
        prompt = _prompt(tok, rec["question"]).to_ints()
        answer = tok.encode(render_solution(rec, "boxed"), add_special_tokens=False) + [tok.eos_token_id]
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    out = training_client.forward(data, "cross_entropy").result()
    return out.metrics["loss_mean"]


def _is_datum(trio, prompt_tokens, seq, advantages):
    """The importance-sampling datum of chapter 03 (prompt positions masked with -100)."""
    from trio_helpers.datums import importance_sampling_datum

    return importance_sampling_datum(prompt_tokens, seq.tokens, seq.logprobs, advantages)


def grpo(trio, svc, tok, records, steps=30, batch=8, group=4, lr=4e-5, seed=0, max_tokens=256):
    from trio_helpers.grading import extract_gsm8k_answer, grade_answer

    tc = svc.create_lora_training_client(STUDENT, rank=32, seed=seed)
    adam = trio.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95)
    rewards = []
    for step in range(steps):
        sampler = tc.save_weights_and_get_sampling_client()
        chunk = [records[(step * batch + i) % len(records)] for i in range(batch)]
        futures = [(rec, _prompt(tok, rec["question"])) for rec in chunk]
        futures = [(rec, p, sampler.sample(p, num_samples=group, sampling_params=trio.SamplingParams(
            max_tokens=max_tokens, seed=seed * 100_000 + step * 1000 + i))) for i, (rec, p) in enumerate(futures)]
        data, step_rewards = [], []
        for rec, p, fut in futures:
            seqs = fut.result().sequences
            r = np.array([grade_answer(s.text, extract_gsm8k_answer(rec["answer"])) for s in seqs])
            step_rewards.extend(r)
            adv = r - r.mean()
            if np.all(adv == 0):
                continue
            data += [_is_datum(trio, p.to_ints(), s, [a] * len(s.tokens)) for s, a in zip(seqs, adv)]
        rewards.append(float(np.mean(step_rewards)))
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            op = tc.optim_step(adam)
            fb.result(), op.result()
    return rewards


def reverse_kl(trio, student_sampler, teacher_sampler, prompts, seed, max_tokens=256, samples=4):
    """Exact mean per-token reverse KL (student || teacher) over the student's own samples of ``prompts``.

    "Exact": at every position the full next-token distributions of both models are compared
    (``sum_v p_s(v) * (log p_s(v) - log p_t(v))``), not a one-sample estimate. Several fixed-seed samples per prompt
    keep the measure from hinging on whether one sample happened to go astray.
    """
    from trio_helpers.offline import exact
    from trio_helpers.offline.model import log_softmax, sequence_rows

    kls = []
    for i, p in enumerate(prompts):
        params = trio.SamplingParams(max_tokens=max_tokens, seed=seed + i)
        for seq in student_sampler.sample(p, num_samples=samples, sampling_params=params).result().sequences:
            tokens = p.to_ints() + seq.tokens
            rows = sequence_rows(tokens[:-1])[len(p.to_ints()) - 1 :]
            ls = log_softmax(student_sampler._model.forward(rows)[1])
            lt = log_softmax(teacher_sampler._model.forward(rows)[1])
            kls.extend((exact.exp(ls) * (ls - lt)).sum(axis=-1))
    return float(np.mean(kls))


def opd(trio, svc, tok, records, heldout, steps=30, batch=8, group=4, lr=4e-5, seed=0, max_tokens=256, coef=1.0):
    tc = svc.create_lora_training_client(STUDENT, rank=32, seed=seed)
    teacher = svc.create_sampling_client(TEACHER)
    adam = trio.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95)
    held = [_prompt(tok, r["question"], "deepmath") for r in heldout]
    before = reverse_kl(trio, tc.save_weights_and_get_sampling_client(), teacher, held, seed=777)
    for step in range(steps):
        sampler = tc.save_weights_and_get_sampling_client()
        chunk = [records[(step * batch + i) % len(records)] for i in range(batch)]
        data = []
        for i, rec in enumerate(chunk):
            p = _prompt(tok, rec["question"], "deepmath")
            seqs = sampler.sample(p, num_samples=group, sampling_params=trio.SamplingParams(
                max_tokens=max_tokens, seed=seed * 100_000 + step * 1000 + i)).result().sequences
            for s in seqs:
                full = trio.ModelInput.from_ints(p.to_ints() + s.tokens)
                t_lp = teacher.compute_logprobs(full).result()[len(p.to_ints()):]
                adv = [-coef * (a - b) for a, b in zip(s.logprobs, t_lp)]
                data.append(_is_datum(trio, p.to_ints(), s, adv))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(adam).result()
    after = reverse_kl(trio, tc.save_weights_and_get_sampling_client(), teacher, held, seed=777)
    return before, after


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", nargs="*", default=[], choices=["grpo", "opd"])
    args = ap.parse_args(argv)
    t = time.perf_counter()
    trio, svc, train, test, deep = _setup()
    tok = None
    res: dict[str, float] = {}
    times: dict[str, float] = {}
    student_tc = svc.create_lora_training_client(STUDENT, rank=32, seed=args.seed)
    teacher_tc = svc.create_lora_training_client(TEACHER, rank=32, seed=args.seed)
    tok = student_tc.get_tokenizer()
    times["load/fit models"] = time.perf_counter() - t
    t = time.perf_counter()
    for name, tc in (("student", student_tc), ("teacher", teacher_tc)):
        sampler = tc.save_weights_and_get_sampling_client()
        res[f"{name}_pass1"] = pass_at_1(trio, sampler, tok, train, 64, 4, 1.0, seed=args.seed)
        res[f"{name}_greedy_test"] = pass_at_1(trio, sampler, tok, test, 100, 1, 0.0, seed=args.seed)
        res[f"{name}_loss"] = corpus_loss(trio, tc, tok, test, 64)
    times["evaluate base models"] = time.perf_counter() - t
    if "grpo" not in args.skip:
        t = time.perf_counter()
        rewards = grpo(trio, svc, tok, train, steps=args.steps, seed=args.seed)
        res["grpo_first5"], res["grpo_last5"] = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
        times["GRPO"] = time.perf_counter() - t
    if "opd" not in args.skip:
        t = time.perf_counter()
        half = len(deep) - 32
        res["opd_kl_before"], res["opd_kl_after"] = opd(trio, svc, tok, deep[:half], deep[half:],
                                                        steps=args.steps, seed=args.seed)
        times["OPD"] = time.perf_counter() - t
    print(f"{'metric':40s} {'student':>9s} {'teacher':>9s}")
    for label, key in (("pass@1 train (T=1, 64x4)", "pass1"), ("greedy accuracy test (100)", "greedy_test"),
                       ("loss per token (test solutions)", "loss")):
        print(f"{label:40s} {res['student_' + key]:9.3f} {res['teacher_' + key]:9.3f}")
    if "grpo_first5" in res:
        print(f"GRPO {args.steps} steps: mean reward first 5 = {res['grpo_first5']:.3f}, last 5 = {res['grpo_last5']:.3f}")
    if "opd_kl_before" in res:
        drop = 1 - res["opd_kl_after"] / res["opd_kl_before"]
        print(f"OPD {args.steps} steps: held-out reverse KL {res['opd_kl_before']:.4f} -> {res['opd_kl_after']:.4f} "
              f"({drop:.0%} lower)")
    for phase, secs in times.items():
        print(f"time {phase:30s} {secs:6.1f} s")
    failed = [name for name, ok in TARGETS.items() if all(k in res for k in _keys(name)) and not ok(res)]
    for name in TARGETS:
        status = "FAIL" if name in failed else ("ok" if all(k in res for k in _keys(name)) else "skipped")
        print(f"target {status:7s} {name}")
    return 1 if failed else 0


def _keys(target: str) -> list[str]:
    if target.startswith("GRPO"):
        return ["grpo_first5"]
    if target.startswith("OPD"):
        return ["opd_kl_before"]
    if "loss" in target:
        return ["student_loss", "teacher_loss"]
    return ["student_pass1", "teacher_pass1"]


if __name__ == "__main__":
    sys.exit(main())
