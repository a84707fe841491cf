"""The one mechanism by which `parallelize`'s transforms rewrite a built module's forward.

Activation checkpointing, activation offload and regional compilation each change what a
module's `forward` does without changing the module: its class is swapped for a generated
subclass that puts a small class of theirs (`Checkpointed`, `Offloaded`, `Compiled`) before the
module's own, whose `forward` wraps `super().forward` (what `fully_shard` does). Parameter names
do not change, as a wrapper module would change them (llmscale keys initial values, offload
units, checkpoints and the planner's shapes by name), and nothing refers back to the module,
so it is freed as soon as it is dropped. Transforms stack: each puts its class before the
classes already there.
"""

from __future__ import annotations

from torch import nn

# One generated subclass per (module class, placed class), shared by every module of that pair.
_SUBCLASSES: dict[tuple[type[nn.Module], type[nn.Module]], type[nn.Module]] = {}


def prepend_class(module: nn.Module, first: type[nn.Module]) -> None:
    """Make `module` an instance of a subclass of (`first`, its current class)."""
    cls = type(module)
    sub = _SUBCLASSES.get((cls, first))
    if sub is None:
        sub = _SUBCLASSES[(cls, first)] = type(f"{first.__name__}{cls.__name__}", (first, cls), {})
    module.__class__ = sub
