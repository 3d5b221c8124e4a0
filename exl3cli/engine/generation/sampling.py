"""Pick the next token from logits through a pipeline of sampler steps.

Steps come from the `exl3_samplers` plugin hook (the built-ins live in
`exl3_plugins.samplers`); each declares typed parameters with defaults and a position
(`order`) in the pipeline. `build_sampler(options)` validates request options against
those declarations and returns a `Sampler` that runs the steps in order, then draws
from the resulting distribution (or takes the argmax when temperature is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from exl3cli.errors import InvalidOption

# Options that are valid in a request but belong to the generation loop or the
# engine, not to a sampler step; build_sampler neither uses nor reports them.
GENERATION_OPTIONS = frozenset(
    {"num_ctx", "num_predict", "stop", "num_keep", "kv_cache_type", "draft_num_predict",
     "num_gpu", "tensor_parallel", "gpu_split", "seed", "truncate"}
)


@dataclass(frozen=True)
class ParamSpec:
    """Type, default and allowed range of one sampler parameter."""

    type: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    help: str = ""

    def coerce(self, name: str, value: Any) -> Any:
        """`value` converted to `type`; InvalidOption when it cannot be or is out of range."""
        if value is None:
            return self.default
        converted = _convert(self.type, value)
        if converted is None:
            raise InvalidOption(
                f"option {name!r}: expected {self.type.__name__}, got {value!r}"
            )
        if self.minimum is not None and converted < self.minimum:
            raise InvalidOption(f"option {name!r}: {value!r} is below {self.minimum}")
        if self.maximum is not None and converted > self.maximum:
            raise InvalidOption(f"option {name!r}: {value!r} is above {self.maximum}")
        return converted


def _convert(kind: type, value: Any) -> Any:
    """Lenient conversion (JSON and Modelfile values arrive as numbers or strings)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        return None
    if isinstance(value, bool):  # True is an int to Python, never a number to a user
        return None
    if kind is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        return number if math.isfinite(number) else None
    if kind is int:
        if isinstance(value, int):
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        return int(number) if math.isfinite(number) and number.is_integer() else None
    if kind is str:
        return value if isinstance(value, str) else None
    return value if isinstance(value, kind) else None


@dataclass
class SamplerContext:
    """What a step may look at besides the logits."""

    options: dict[str, Any]  # every step's parameters, validated, defaults filled in
    history: list[int]  # prompt and generated token ids so far, oldest first
    generator: torch.Generator | None = None  # use for any randomness (seeded runs)


class SamplerStep:
    """One stage of the pipeline. Subclass it, set the class attributes, define apply().

    `apply` gets float32 logits of shape [V] and returns logits of the same shape;
    removed tokens are set to -inf. Steps that only reshape the distribution (and
    cannot matter to an argmax) set `skip_when_greedy` so temperature 0 is exact.
    """

    name: str = ""
    order: int = 0
    params: dict[str, ParamSpec] = {}
    skip_when_greedy: bool = False

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<SamplerStep {self.name} order={self.order}>"


@dataclass
class Sampler:
    """A configured pipeline; `sample` returns one token id."""

    steps: list[SamplerStep]
    options: dict[str, Any]
    seed: int | None = None
    unknown_options: list[str] = field(default_factory=list)
    _generators: dict[str, torch.Generator] = field(default_factory=dict, repr=False)

    @property
    def greedy(self) -> bool:
        return float(self.options.get("temperature", 1.0)) <= 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """One seeded generator per device, so a seed gives the same draws every run."""
        if self.seed is None:
            return None
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return self._generators[key]

    def process(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The logits after every active step (what `sample` draws from)."""
        logits = logits.detach().to(torch.float32).flatten().clone()
        ctx = SamplerContext(self.options, history, self.generator(logits.device))
        greedy = self.greedy
        for step in self.steps:
            if greedy and step.skip_when_greedy:
                continue
            logits = step.apply(logits, ctx)
        return logits

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        processed = self.process(logits, history)
        if self.greedy:
            return int(torch.argmax(processed))
        probs = torch.softmax(processed, dim=-1)
        if not torch.isfinite(probs).all() or float(probs.sum()) <= 0:
            return int(torch.argmax(processed))  # everything masked: fall back to the best
        token = torch.multinomial(probs, 1, generator=self.generator(probs.device))
        return int(token)


def collect_steps() -> list[SamplerStep]:
    """Every step that installed plugins provide, in pipeline order."""
    from exl3cli.hookspecs import get_plugin_manager

    steps: list[SamplerStep] = []
    for result in get_plugin_manager().hook.exl3_samplers():
        steps.extend(result or [])
    names: dict[str, SamplerStep] = {}
    for step in steps:
        if step.name in names:
            raise InvalidOption(f"two sampler plugins define a step named {step.name!r}")
        names[step.name] = step
    return sorted(steps, key=lambda step: (step.order, step.name))


def parameter_specs(steps: list[SamplerStep]) -> dict[str, ParamSpec]:
    """All parameters of `steps`; a name two steps share must have one spec."""
    specs: dict[str, ParamSpec] = {}
    for step in steps:
        for name, spec in step.params.items():
            if name in specs and specs[name] != spec:
                raise InvalidOption(f"sampler parameter {name!r} is declared twice, differently")
            specs[name] = spec
    return specs


def sampler_defaults() -> dict[str, Any]:
    """{parameter: default} over the installed steps (for `show` and docs)."""
    return {name: spec.default for name, spec in parameter_specs(collect_steps()).items()}


def build_sampler(options: dict[str, Any] | None = None) -> Sampler:
    """A Sampler for request `options`.

    Values are validated against the steps' ParamSpecs (InvalidOption on bad ones);
    keys no step knows and that are not GENERATION_OPTIONS are ignored and listed in
    `Sampler.unknown_options` so callers can warn. `seed` >= 0 makes draws repeatable.
    """
    options = dict(options or {})
    steps = collect_steps()
    specs = parameter_specs(steps)
    resolved = {name: spec.coerce(name, options.get(name)) for name, spec in specs.items()}
    unknown = sorted(k for k in options if k not in specs and k not in GENERATION_OPTIONS)
    seed = ParamSpec(int, -1).coerce("seed", options.get("seed"))
    return Sampler(
        steps=steps,
        options=resolved,
        seed=seed if seed >= 0 else None,
        unknown_options=unknown,
    )
