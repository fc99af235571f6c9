"""Teacher forcing: a GPU engine's greedy run against a CPU engine scoring the same tokens (no cupy here).

The GPU engine generates with logprobs and prompt_logprobs; the CPU engine is then given each prompt plus the
GPU's tokens and scores every position (prompt_logprobs). Position p compares both engines' distributions of
token p + 1 of that sequence: whether their argmax agrees, and the logprob each gives the token that is there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def top2(entry: dict[int, float]) -> tuple[int, float]:
    """(argmax token, top-1 minus top-2 logprob) of a logprob dict holding at least the top 2."""
    best = sorted(entry.items(), key=lambda kv: -kv[1])[:2]
    return best[0][0], best[0][1] - best[1][1]


@dataclass(slots=True, frozen=True)
class TeacherForced:
    agree: np.ndarray  # [P] bool: the GPU's argmax is the CPU's
    decisive: np.ndarray  # [P] bool: the CPU's top-2 gap exceeds margin x scale (not a coin toss)
    gpu_target: np.ndarray  # [P] the GPU's logprob of the token at p + 1
    error: float  # max |target logprob, GPU - CPU| / scale

    def check(self, least_decisive: float, max_error: float, decisive_agreement: float = 0.98) -> None:
        """AssertionError unless: every GPU target logprob is finite, more than `least_decisive` of the positions
        are decisive, at least `decisive_agreement` of those agree, and the error stays below `max_error`."""
        assert np.isfinite(self.gpu_target).all()
        assert self.decisive.mean() > least_decisive, self.summary()
        assert self.agree[self.decisive].mean() >= decisive_agreement, self.summary()
        assert self.error < max_error, self.summary()

    def summary(self) -> str:
        return (f"{len(self.agree)} positions, agreement {self.agree.mean():.4f} (on {self.decisive.sum()} decisive "
                f"{self.agree[self.decisive].mean():.4f}), max |target logprob err| / scale {self.error:.2e}")


def teacher_forced(requests: dict[str, list[int]], gpu: dict, cpu: dict, margin: float) -> TeacherForced:
    """requests: key -> prompt ids; gpu / cpu: key -> RequestOutput of the generating and the scoring engine.
    The scale of "noise" is the largest |target logprob| of the CPU: a random target spans the logit range."""
    gpu_entries, cpu_entries, targets = [], [], []
    for key, prompt in requests.items():
        out = gpu[key].outputs[0]
        gpu_entries += gpu[key].prompt_logprobs[1:] + out.logprobs
        cpu_entries += cpu[key].prompt_logprobs[1:]  # position p scores token p + 1 of prompt + generated
        targets += (prompt + out.token_ids)[1:]
    if not len(gpu_entries) == len(cpu_entries) == len(targets):
        raise RuntimeError(f"{len(gpu_entries)} GPU positions, {len(cpu_entries)} CPU, {len(targets)} targets")
    gpu_top, cpu_top = [top2(e) for e in gpu_entries], [top2(e) for e in cpu_entries]
    gpu_target = np.array([e[t] for e, t in zip(gpu_entries, targets)])  # [P]
    cpu_target = np.array([e[t] for e, t in zip(cpu_entries, targets)])  # [P]
    scale = np.abs(cpu_target).max()
    return TeacherForced(agree=np.array([g[0] == c[0] for g, c in zip(gpu_top, cpu_top)]),
                         decisive=np.array([c[1] for c in cpu_top]) > margin * scale, gpu_target=gpu_target,
                         error=float(np.abs(gpu_target - cpu_target).max() / scale))
