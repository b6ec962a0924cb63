"""What every server and client of a job agrees on: the model, the batch, the stages and their
servers; and the arithmetic of who owns which rows and which parameters.

Rows are the samples of a batch, numbered 0..B-1; micro-batch m is rows [m B/d, (m+1) B/d).
Each of a stage's frontal servers owns an even segment of every micro-batch, and so does each
backward server (the paper's even segmentation): activations and gradients between stages go
from the owner of some rows on one side to the owner of the same rows on the other.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch



def segment(i: int, n: int, lo: int, hi: int) -> tuple[int, int]:
    """The i-th of n even, contiguous pieces of [lo, hi)."""
    size = hi - lo
    return lo + i * size // n, lo + (i + 1) * size // n


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclasses.dataclass(frozen=True)
class Server:
    name: str
    address: str  # host:port it serves on (or advertises)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    layers: tuple[int, int]
    frontal: tuple[Server, ...]
    backward: tuple[Server, ...]

    @property
    def servers(self) -> tuple[Server, ...]:
        """Every server of the stage; a server's place here is the parameter shard it holds."""
        return self.frontal + self.backward


@dataclasses.dataclass(frozen=True)
class Job:
    """A training job over parameter-server pipeline stages."""

    model: dict[str, Any]
    stages: tuple[StageSpec, ...]
    batch: int
    microbatches: int
    seq: int
    steps: int
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    delayed_updates: bool = False  # DPU: step s computes with the parameters of step s - 1
    task_timeout: float = 30.0  # a task not finished by then goes back to the pool
    liveness: float = 3.0  # a client silent for this long is taken to have left (clients beat every 0.5 s)
    push_timeout: float = 30.0  # a live client that has not pushed its gradient by then is redone
    data: str = ""  # a token file every server of the first and last stage has at this path ("": the byte corpus)
    data_dtype: str = ""  # its dtype ("": the file's sidecar's, else uint16)

    def __post_init__(self) -> None:
        for f in ("batch", "microbatches", "seq", "steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"job {f}={v!r}; expected a positive integer")
        if self.batch % self.microbatches:
            raise ValueError(f"job batch={self.batch} does not split into {self.microbatches} equal micro-batches")
        from heteropp.model_spec import ModelSpec

        longest = ModelSpec.from_config(self.model).seq
        if self.seq > longest:
            raise ValueError(f"job seq={self.seq} exceeds the model's longest sequence, {longest} positions")
        spec = self.spec
        if spec.tied_embeddings and len(self.stages) > 1:
            raise ValueError("the model ties its embedding and LM head, which a volunteer job's first and last stages "
                             "would hold apart; untie them (tie_word_embeddings: false) or use one stage")
        first = 0
        for k, s in enumerate(self.stages):
            if s.layers[0] != first or s.layers[1] <= s.layers[0]:
                raise ValueError(f"stage {k} has layers {list(s.layers)}; expected a non-empty range starting at {first}")
            if not s.frontal or not s.backward:
                raise ValueError(f"stage {k} needs at least one frontal and one backward server")
            if len(s.frontal) > self.microbatch_samples or len(s.backward) > self.microbatch_samples:
                raise ValueError(f"stage {k}: more servers on one side than the {self.microbatch_samples} rows "
                                 "of a micro-batch to give them")
            first = s.layers[1]
        if not self.stages or first != spec.n_layers:
            raise ValueError(f"the stages cover layers [0, {first}); the model has {spec.n_layers}")
        names = [srv.name for s in self.stages for srv in s.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique, got {names}")

    @functools.cached_property
    def spec(self):
        """The model's shape (``heteropp.model_spec.ModelSpec``) at the job's sequence length."""
        from heteropp.model_spec import ModelSpec

        return ModelSpec.from_config(self.model, seq=self.seq)

    @functools.cached_property
    def family(self):
        """The model's definition (``heteropp.runtime.model_family``): the project's LLaMA or a
        Hugging Face decoder."""
        from heteropp.runtime.model_family import model_family

        return model_family(self.spec)

    def training_tokens(self):
        """The tokens batches are drawn from (checked against the model's vocabulary)."""
        from dimodel.datasets import training_tokens

        return training_tokens(self.data or None, self.data_dtype or None, self.spec.vocab)[0]

    @property
    def microbatch_samples(self) -> int:
        return self.batch // self.microbatches

    def microbatch_rows(self, m: int) -> tuple[int, int]:
        return m * self.microbatch_samples, (m + 1) * self.microbatch_samples

    def owned_rows(self, side: tuple[Server, ...], index: int, m: int) -> tuple[int, int]:
        """Rows of micro-batch m that server ``index`` of ``side`` owns."""
        return segment(index, len(side), *self.microbatch_rows(m))

    def owners(self, side: tuple[Server, ...], m: int, rows: tuple[int, int]) -> list[tuple[int, tuple[int, int]]]:
        """(server index, rows it owns) for every server of ``side`` owning some of ``rows``."""
        out = []
        for i in range(len(side)):
            o = overlap(self.owned_rows(side, i, m), rows)
            if o:
                out.append((i, o))
        return out

    def find(self, name: str) -> tuple[int, str, int]:
        """(stage, 'frontal' | 'backward', index) of server ``name``."""
        for k, s in enumerate(self.stages):
            for side in ("frontal", "backward"):
                for i, srv in enumerate(getattr(s, side)):
                    if srv.name == name:
                        return k, side, i
        raise KeyError(f"server {name!r} is not in the job; its servers are "
                       f"{[srv.name for s in self.stages for srv in s.servers]}")

    # -- models ------------------------------------------------------------------------------
    def stage_module(self, k: int) -> torch.nn.Module:
        """Stage k's layers, initialised as the full model with the job's seed would be."""
        from heteropp.runtime.tensor_parallel import SINGLE

        family = self.family
        stage = family.stage(self.stages[k].layers, k == 0, k == len(self.stages) - 1, SINGLE)
        stage.load_full(family.initial_state(self.seed), strict=True)
        return stage

    def stage_parameters(self, k: int) -> int:
        """How many parameters stage k holds (without building it)."""
        spec = self.spec
        first, last = self.stages[k].layers
        return ((last - first) * spec.params_per_layer + (spec.embedding_params if k == 0 else 0)
                + (spec.head_params if k == len(self.stages) - 1 else 0))

    def boundary_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.seq, self.spec.hidden)

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stages"] = [{"layers": list(s.layers), "frontal": [dataclasses.asdict(x) for x in s.frontal],
                        "backward": [dataclasses.asdict(x) for x in s.backward]} for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        try:
            stages = tuple(StageSpec(tuple(s["layers"]), tuple(Server(str(x["name"]), str(x["address"])) for x in s["frontal"]),
                                     tuple(Server(str(x["name"]), str(x["address"])) for x in s["backward"]))
                           for s in d["stages"])
            fields = {f.name for f in dataclasses.fields(cls)} - {"stages"}
            unknown = sorted(set(d) - fields - {"stages"})
            if unknown:
                raise ValueError(f"unknown job field(s) {unknown}")
            return cls(stages=stages, **{k: d[k] for k in fields if k in d})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed job description: {exc!r}") from None

    @classmethod
    def from_allocation(cls, alloc: dict, model: dict, require_addresses: bool = True, **training: Any) -> "Job":
        """The job an ``alloc.json`` describes: its stages, with each server's address from the fleet
        (``require_addresses=False``: "" where the fleet gives none yet, to check a plan made before)."""
        addresses = {d["name"]: d.get("address") for d in alloc["fleet"]["reliable"]}

        def servers(names: list[str]) -> tuple[Server, ...]:
            missing = [n for n in names if not addresses.get(n)]
            if missing and require_addresses:
                raise ValueError(f"devices {missing} have no 'address' in the fleet; servers need host:port")
            return tuple(Server(n, addresses.get(n) or "") for n in names)

        stages = tuple(StageSpec(tuple(s["layers"]), servers(s["frontal"]), servers(s["backward"])) for s in alloc["stages"])
        w = alloc["workload"]
        return cls(model=model, stages=stages, batch=w["batch"], microbatches=w["microbatches"], **training)



def flat_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in module.named_parameters()]


def shard_bounds(total: int, shards: int, index: int) -> tuple[int, int]:
    """Elements [lo, hi) of a stage's flat parameter vector that shard ``index`` holds."""
    return segment(index, shards, 0, total)
