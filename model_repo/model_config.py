"""The part of Triton's ModelConfig protobuf (model_config.proto, server 2.51) that this repository uses, as
frozen dataclasses that `model_repo.pbtxt` writes and reads. Field names are the protobuf's own."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runtime.errors import ConfigError


class DataType(enum.Enum):
    TYPE_BOOL = "BOOL"
    TYPE_UINT8 = "UINT8"
    TYPE_UINT64 = "UINT64"
    TYPE_INT32 = "INT32"
    TYPE_INT64 = "INT64"
    TYPE_FP32 = "FP32"
    TYPE_FP64 = "FP64"
    TYPE_STRING = "BYTES"  # value: the wire datatype name clients use (tritonclient's "BYTES")

    @property
    def wire(self) -> str:
        return self.value


class Kind(enum.Enum):
    KIND_AUTO = 0
    KIND_CPU = 1
    KIND_GPU = 2


@dataclass(frozen=True)
class Reshape:
    """ModelTensorReshape: shape () reshapes a [1] input to a scalar (the tensorrtllm backend's scalar inputs)."""

    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInput:
    name: str
    data_type: DataType
    dims: tuple[int, ...]
    optional: bool = False
    reshape: Reshape | None = None
    allow_ragged_batch: bool | None = None


@dataclass(frozen=True)
class ModelOutput:
    name: str
    data_type: DataType
    dims: tuple[int, ...]


@dataclass(frozen=True)
class InstanceGroup:
    kind: Kind
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ConfigError(f"instance_group.count must be an int >= 1, got {self.count!r}")


@dataclass(frozen=True)
class TransactionPolicy:
    decoupled: bool


@dataclass(frozen=True)
class QueuePolicy:
    max_queue_size: int | None = None  # 0 or unset: unbounded


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int | None = None
    default_queue_policy: QueuePolicy | None = None


@dataclass(frozen=True)
class ModelParameter:
    string_value: str


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    model_version: int
    input_map: dict[str, str]  # the step model's input name -> ensemble tensor name
    output_map: dict[str, str]  # the step model's output name -> ensemble tensor name


@dataclass(frozen=True)
class EnsembleScheduling:
    step: tuple[EnsembleStep, ...]


@dataclass(frozen=True, kw_only=True)
class TritonModelConfig:
    """Triton's ModelConfig message (a config.pbtxt), named apart from the runtime's `runtime.config.ModelConfig`."""

    name: str
    backend: str | None = None  # "python" for python models
    platform: str | None = None  # "ensemble" for ensembles
    max_batch_size: int
    input: tuple[ModelInput, ...]
    output: tuple[ModelOutput, ...]
    instance_group: tuple[InstanceGroup, ...] = ()
    model_transaction_policy: TransactionPolicy | None = None
    parameters: dict[str, ModelParameter] = field(default_factory=dict)
    ensemble_scheduling: EnsembleScheduling | None = None
    dynamic_batching: DynamicBatching | None = None

    def __post_init__(self) -> None:
        if (self.backend is None) == (self.platform is None):
            raise ConfigError(f"model {self.name!r}: exactly one of backend and platform must be set")
        if (self.platform == "ensemble") != (self.ensemble_scheduling is not None):
            raise ConfigError(
                f"model {self.name!r}: ensemble_scheduling goes with platform \"ensemble\" and only with it"
            )
        for group, items in (("input", self.input), ("output", self.output)):
            names = [t.name for t in items]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ConfigError(f"model {self.name!r}: duplicate {group} name(s) {dup}")

    def parameter(self, key: str) -> str:
        """A parameters value (ConfigError naming the key when it is absent)."""
        if key not in self.parameters:
            raise ConfigError(f"model {self.name!r}: parameters has no {key!r} (has {sorted(self.parameters)})")
        return self.parameters[key].string_value

    @property
    def decoupled(self) -> bool:
        return self.model_transaction_policy is not None and self.model_transaction_policy.decoupled


__all__ = [
    "DataType",
    "DynamicBatching",
    "EnsembleScheduling",
    "EnsembleStep",
    "InstanceGroup",
    "Kind",
    "TritonModelConfig",
    "ModelInput",
    "ModelOutput",
    "ModelParameter",
    "QueuePolicy",
    "Reshape",
    "TransactionPolicy",
]
