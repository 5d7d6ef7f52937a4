"""The ``--strategies`` mini-language of ``shoal bench``: ``sync,local-sgd:tau=4,lr_outer=0.7``."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies import get_strategy, make_options, option_fields
from shoal.strategies.topology import Topology

#: The label of the hand-written DDP loop's rows; not a strategy one can name.
REFERENCE = "ddp-reference"
#: Run settings a strategy of the sweep may set for itself, as its options are set
#: (``async-sgd:momentum=0``): each algorithm's own optimizer, the others keep the sweep's.
RUN_SETTINGS = ("optimizer", "lr", "momentum", "nesterov", "weight_decay", "schedule",
                "warmup_epochs", "scale_lr")


@dataclass(frozen=True)
class StrategySpec:
    """A strategy and the options it runs with in the benchmark (``local-sgd:tau=4``); its
    options may also be :data:`RUN_SETTINGS` (``async-sgd:momentum=0``)."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name

    def topology(self, workers: int) -> Topology:
        """How this strategy lays out a run of ``workers`` workers, with its options (their
        text read as a ``--config`` file's values are)."""
        cls = get_strategy(self.name)
        known = {f.name for f in option_fields(cls)}
        values = {k: yaml.safe_load(v) for k, v in self.options if k in known}
        return cls.topology(make_options(cls, values), workers)

    def flags(self) -> list[str]:
        """``shoal train`` flags for the options (``tau=4`` -> ``--tau 4``)."""
        out = ["--strategy", self.name]
        for key, value in self.options:
            flag = flag_name(key)
            if value.lower() in ("true", "false"):
                out.append(flag if value.lower() == "true" else "--no-" + flag[2:])
            else:
                out += [flag, value]
        return out


def parse_strategies(text: str, common: str = "") -> list[StrategySpec]:
    """``sync,local-sgd:tau=4,lr_outer=0.7,easgd:tau=16`` -> three specs.

    A comma-separated item without ``=`` starts a new strategy; ``name:key=value`` starts one
    with an option; a bare ``key=value`` adds an option to the strategy before it.
    ``common`` options (``tau=4``) go to every strategy that takes them.
    """

    specs: list[tuple[str, dict[str, str]]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, colon, rest = item.partition(":")
        if colon or "=" not in item:
            if "=" in name:
                raise ShoalError(f"--strategies: {item!r} must start with a strategy name")
            specs.append((name, {}))
            item = rest
            if not item:
                continue
        if not specs:
            raise ShoalError(f"--strategies: option {item!r} comes before any strategy")
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ShoalError(f"--strategies: expected key=value, got {item!r}")
        specs[-1][1][key.replace("-", "_")] = value
    if not specs:
        raise ShoalError("--strategies is empty")
    shared = _options(common, "--strategy-options")
    out = []
    for name, opts in specs:
        if name == REFERENCE:
            raise ShoalError(f"{REFERENCE} is added by shoal bench itself (--no-reference "
                             "leaves it out)")
        cls = get_strategy(name)
        takes = {f.name for f in option_fields(cls)}
        for key in opts:
            if key not in takes and key not in RUN_SETTINGS:
                raise ShoalError(f"strategy {name} does not take option {key!r} (it takes "
                                 f"{', '.join(sorted(takes)) or 'none'}; any strategy takes the "
                                 f"run settings {', '.join(RUN_SETTINGS)})")
        merged = {k: v for k, v in shared.items() if k in takes} | opts
        out.append(StrategySpec(name, tuple(sorted(merged.items()))))
    return out


def _options(text: str, what: str) -> dict[str, str]:
    opts = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ShoalError(f"{what}: expected key=value, got {item!r}")
        opts[key.replace("-", "_")] = value
    return opts
