"""Why no plan fits: the binding constraint among what the search space ruled out."""
from __future__ import annotations

from .space import SearchSpace


def explain(space: SearchSpace) -> str:
    why, model = space.why, space.model
    mem = [v for k, v in why.items() if k.startswith("mem:")]
    # the binding constraint: a chip type that cannot hold one layer in any configuration
    for c in space.types:
        keys = [k for k in why if k.startswith(f"mem:{c.name}:")]
        tps = c.tp_sizes()
        if keys and len(keys) >= 2 * len([t for t in tps if model.kv_heads % t == 0]):
            last = why[max(keys, key=lambda k: (int(k.split(':')[2]), k.split(':')[3] == 'True'))]
            return f"no plan fits: chip {c.name!r} cannot hold one layer in any configuration ({last})"
    if "layers" in why:
        return ("no plan fits: memory: in every configuration some chip type's stages cannot hold their share "
                f"of the {model.n_layers} layers with the warm-up micro-batches of 1F1B"
                + (f"; e.g. {mem[0]}" if mem else ""))
    deep = [v for k, v in why.items() if k.startswith("stages:")]
    if deep:
        deep.sort(key=lambda v: not v[1])  # a chip too deep even at its largest TP binds
        return f"no plan fits: pipeline too deep: {deep[0][0]}"
    return "no plan fits: " + ("; ".join(str(v) for v in list(why.values())[:3])
                               or "no configuration passed the constraints")
