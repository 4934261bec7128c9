"""How many prompt tokens an engine step computes beside the running streams' decodes.

Every running stream waits for each step to get its next token, so a step that also computes
prompt tokens is a pause in every stream. As Sarathi-Serve's stall-free batching does, the
prompt tokens beside decodes are bounded by a target time per step: the time between a stream's
tokens (TPOT) that `--target-tpot-ms` asks for. Fewer running streams leave room for more
prompt tokens; a step without decodes takes the whole batch.

On a CPU a step's time is close to linear in its tokens: a fixed part (the weights are read
once per step), a part per decode token (its attention over its context, its logits) and a part
per prompt token. The engine measures every step and fits the three by least squares, so the
budget follows the model, the machine and the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig

# Beside any number of streams a step takes at least this many prompt tokens: no prompt starves,
# however many streams run or however tight the target.
MIN_PROMPT_TOKENS = 16


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: fixed + per decode token + per prompt token."""

    fixed: float
    per_decode: float
    per_prompt: float

    def seconds(self, n_decode: int, n_prompt: int) -> float:
        return self.fixed + self.per_decode * n_decode + self.per_prompt * n_prompt

    def prompt_tokens_within(self, seconds: float, n_decode: int) -> int:
        """Prompt tokens a step with n_decode decodes can take and stay within `seconds`."""
        return max(0, int((seconds - self.seconds(n_decode, 0)) / self.per_prompt))


# SmolLM2 135M on 2 cores (../shared/notes/llama-cpp.md): decoding 1 sequence takes 12 ms, 8
# together 64 ms, a prompt token 4.4 ms in a long chunk. Only a starting point: the fit takes
# over after a few steps.
PRIOR = StepCost(fixed=0.0046, per_decode=0.0074, per_prompt=0.0044)


class StepCostFit:
    """StepCost fitted to the measured steps: least squares over (1, decode tokens, prompt
    tokens), each step's weight decaying by half every `half_life` steps, starting from PRIOR
    worth `prior_steps` steps (a ridge toward it, which also keeps the fit defined before the
    steps vary)."""

    def __init__(self, prior: StepCost = PRIOR, half_life: int = 200,
                 prior_steps: float = 4.0) -> None:
        self._decay = 0.5 ** (1 / half_life)
        coefficients = np.array([prior.fixed, prior.per_decode, prior.per_prompt])
        # The prior as pseudo-observations: one per coefficient, at typical step shapes.
        shapes = np.array([[1.0, 1, 0], [1.0, 8, 0], [1.0, 1, 128]])
        weight = prior_steps / len(shapes)
        self._xtx = weight * shapes.T @ shapes
        self._xty = weight * shapes.T @ (shapes @ coefficients)
        self._cost: StepCost | None = prior

    def observe(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        x = np.array([1.0, n_decode, n_prompt])
        self._xtx = self._decay * self._xtx + np.outer(x, x)
        self._xty = self._decay * self._xty + x * seconds
        self._cost = None  # solved when next read: most steps (decodes alone) never read it

    @property
    def cost(self) -> StepCost:
        if self._cost is None:
            fixed, per_decode, per_prompt = np.linalg.solve(self._xtx, self._xty)
            # A noisy fit must not turn a cost negative: then keep the prior's.
            self._cost = StepCost(max(fixed, 0.0),
                                  per_decode if per_decode > 0 else PRIOR.per_decode,
                                  per_prompt if per_prompt > 0 else PRIOR.per_prompt)
        return self._cost


class FixedStepCost:
    """A step cost taken as given and never measured (EngineConfig.step_tokens, for tests)."""

    def __init__(self, cost: StepCost = PRIOR) -> None:
        self.cost = cost

    def observe(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        pass


@dataclass
class Scheduler:
    """The prompt-token budget of each step, from the target time between a stream's
    tokens."""

    target_seconds: float
    fit: StepCostFit | FixedStepCost
    # The engine may compute the prompt tokens in a call after the decodes' (engine/batching.py,
    # FA_TILE_ROWS), which pays the fixed part again.
    prompts_apart: bool = False
    # A budget in tokens instead of one from the target and the fit (EngineConfig.step_tokens).
    fixed_tokens: int | None = None

    @classmethod
    def for_config(cls, config: EngineConfig, prompts_apart: bool) -> Scheduler:
        if config.step_tokens is None:
            return cls(config.target_tpot_ms / 1000, StepCostFit(), prompts_apart)
        return cls(config.target_tpot_ms / 1000, FixedStepCost(), prompts_apart,
                   fixed_tokens=config.step_tokens)

    def prompt_budget(self, n_decode: int, capacity: int) -> int:
        """Prompt tokens a step may take beside n_decode decodes, within `capacity` tokens."""
        if n_decode == 0:  # nobody waits for this step: the whole batch
            return capacity
        if self.fixed_tokens is not None:
            return min(capacity - n_decode, self.fixed_tokens)
        cost = self.fit.cost
        target = self.target_seconds - (cost.fixed if self.prompts_apart else 0.0)
        within = cost.prompt_tokens_within(target, n_decode)
        return min(capacity - n_decode, max(MIN_PROMPT_TOKENS, within))
