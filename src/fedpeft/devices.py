"""Where the model computes and in what precision: ``engine.device``, ``engine.precision``,
``engine.gradient_checkpointing``, ``engine.deterministic``, ``model.dtype``, ``model.quantization``.

One :class:`Placement` per process, made from the config by :func:`fedpeft.experiment.prepare`,
is the only place the device enters: :func:`place_model` puts the model on it (frozen backbone in
``model.dtype``, trainable parameters fp32) and wraps the model's forward in autocast (as HF
Accelerate does: every call, in training, evaluation and every method's probes, computes in the
chosen precision), the encoded data carry it so that every batch is built there
(:attr:`fedpeft.models.encoding.EncodedData.device`), and :class:`fedpeft.federated.client.ModelSlot`
copies what leaves the model (its reads, the clients' updates) back to the CPU. So the server's
state, the codecs, the wire and the checkpoints only ever hold CPU tensors, and the bytes on the
wire do not depend on the device. Optimizers are built on the model's own parameters, so their
state lives on the device too.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedpeft.config import ConfigError

if TYPE_CHECKING:
    from fedpeft.config import EngineConfig, ExperimentConfig, ModelConfig

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZABLE_ADAPTERS = ("lora", "ffa_lora")
"""Adapters that leave the frozen weights untouched: the only ones a quantised backbone can serve."""
DETERMINISTIC_CUBLAS = ":4096:8"
CPU = torch.device("cpu")


def device_problem(name: str) -> str | None:
    """Why ``engine.device: name`` cannot run on this machine (None: it can)."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"torch {torch.__version__}"
            return f"{name} needs a CUDA GPU, and {build} sees none; use cpu or auto"
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            return f"{name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    if name == "mps" and not torch.backends.mps.is_available():
        return "mps needs Apple Metal (MPS), which this machine lacks; use cpu or auto"
    return None


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name (``NVIDIA H200``, ``AMD EPYC 7B13``); MPS: ``Apple MPS``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA if present, else MPS, else CPU; ``cuda`` -> the GPU of this process's
    ``LOCAL_RANK`` (torchrun: one GPU per rank), else the current one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) % torch.cuda.device_count() if local_rank is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device(name)


def accelerator_problem(cfg: ExperimentConfig) -> tuple[str, str] | None:
    """The first (field, message) that makes the precision, dtype, checkpointing or quantisation
    settings impossible on this machine or with this method (None: all fine)."""
    engine, model = cfg.engine, cfg.model
    device = resolve_device(engine.device)
    if engine.precision == "fp16" and device.type == "cpu":
        return "engine.precision", "fp16 autocast (with a gradient scaler) needs a GPU (CUDA or MPS); on a CPU use bf16"
    if engine.precision != "fp32" and cfg.client.dp is not None:
        return "engine.precision", ("client.dp computes per-example gradients in fp32 only (Opacus's hooks and "
                                    "clipping do not follow autocast); use fp32")
    if model.dtype != "fp32" and engine.precision != model.dtype:
        return "model.dtype", (f"a {model.dtype} backbone needs engine.precision: {model.dtype} (autocast is what lets "
                               f"the fp32 adapters and the {model.dtype} weights meet)")
    if engine.gradient_checkpointing and cfg.client.dp is not None:
        return "engine.gradient_checkpointing", ("cannot be combined with client.dp: the recomputed forward would fire "
                                                 "Opacus's per-example hooks twice")
    if model.quantization != "none":
        return _quantization_problem(cfg, device)
    return None


def _quantization_problem(cfg: ExperimentConfig, device: torch.device) -> tuple[str, str] | None:
    from fedpeft.recipes import RECIPES

    field, kind = "model.quantization", cfg.model.quantization
    if cfg.adapter.kind not in QUANTIZABLE_ADAPTERS:
        return field, (f"{kind} stores the frozen weights quantised, which serves the LoRA family only (adapter.kind "
                       f"{', '.join(QUANTIZABLE_ADAPTERS)}); adapter {cfg.adapter.kind!r} (method {cfg.method}) needs "
                       "full-precision weights")
    if cfg.adapter.init == "svd":
        return field, (f"{kind} is refused with FeDeRA's svd init: it rewrites the frozen weight as W0 - B0 A0, which "
                       "needs the dense weight; use init kaiming or gaussian, or quantization none")
    if RECIPES[cfg.method].algorithm == "headprune":
        return field, f"{kind} is refused with head pruning: it slices the frozen q/k/v/o weights per head"
    if cfg.model.name.startswith("tiny-"):
        return field, f"{kind} quantises a pretrained checkpoint while loading it; {cfg.model.name} is built in code"
    if importlib.util.find_spec("bitsandbytes") is None:
        return field, f"{kind} needs bitsandbytes, which is not installed: pip install 'fedpeft[quant]'"
    if device.type != "cuda":
        return field, f"{kind} needs a CUDA GPU (bitsandbytes kernels); engine.device resolves to {device}"
    return None


def quantization_kwargs(model: ModelConfig, device: torch.device, keep: tuple[str, ...]) -> dict[str, Any]:
    """``from_pretrained`` arguments that load the backbone quantised on ``device`` (empty: no
    quantisation). 4bit is QLoRA's recipe: NF4, double quantisation, bf16 compute; ``keep`` names
    modules left unquantised (the task head, which trains)."""
    if model.quantization == "none":
        return {}
    from transformers import BitsAndBytesConfig

    if model.quantization == "4bit":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=list(keep))
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(keep))
    return {"quantization_config": config, "device_map": {"": device}, "dtype": DTYPES[model.dtype]}


@dataclass(frozen=True)
class Placement:
    """The device this process computes on and the autocast precision (``fp32``: none)."""

    device: torch.device = CPU
    precision: str = "fp32"
    cudnn_attention: bool = False

    @classmethod
    def from_config(cls, engine: EngineConfig) -> Placement:
        return cls(resolve_device(engine.device), engine.precision, engine.cudnn_attention)

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to the precision on this device (a no-op in fp32).

        On CUDA in bf16/fp16, scaled-dot-product attention is also kept to the flash, memory-efficient
        and math kernels unless ``engine.cudnn_attention``: PyTorch otherwise picks cuDNN's fused
        attention, which on an H200 (torch 2.11) spent about 3.3 ms of CPU on every call (batches of 8
        at up to 64 tokens), 57% of a bf16 MiniLM run's CPU time, so bf16 ran 2.8x slower than fp32
        (``benchmarks/results/device_cuda_profile.md``); kept off it, bf16 rounds took 0.56 s against
        1.48 s (``device_cuda.md``). cuDNN never serves fp32, and the CPU has no such kernel, so
        neither is touched."""
        if self.precision == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=DTYPES[self.precision]), self.attention_kernels():
            yield

    @property
    def keeps_attention_off_cudnn(self) -> bool:
        return self.precision != "fp32" and self.device.type == "cuda" and not self.cudnn_attention

    def attention_kernels(self) -> AbstractContextManager[Any]:
        """The scaled-dot-product attention kernels this placement allows (see :meth:`autocast`): without
        cuDNN's on CUDA in bf16/fp16 unless ``engine.cudnn_attention``, else PyTorch's own choice."""
        if not self.keeps_attention_off_cudnn:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def describe(self) -> str:
        """Where and how this process computes, for a run's summary: ``cuda:0 (NVIDIA H200), fp32,
        torch 2.11.0+cu130`` (a run's numbers depend on the device's kernels, so a result says it)."""
        return f"{self.device} ({device_name(self.device)}), {self.precision}, torch {torch.__version__}"

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
        return torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None


def place_model(model: nn.Module, trainable: list[str], cfg: ExperimentConfig, placement: Placement) -> None:
    """Put ``model`` on the placement's device, in place: frozen floating-point parameters in
    ``model.dtype``, trainable ones fp32; its forward under autocast; gradient checkpointing when
    asked. Quantised weights were placed when they were loaded and stay as they are."""
    configure_determinism(cfg.engine, placement.device)
    frozen_dtype, trainable_set = DTYPES[cfg.model.dtype], set(trainable)
    for name, param in model.named_parameters():
        if _quantized(param):
            continue
        dtype = torch.float32 if name in trainable_set else frozen_dtype
        if param.device != placement.device or (param.is_floating_point() and param.dtype != dtype):
            param.data = param.data.to(placement.device, dtype if param.is_floating_point() else param.dtype)
    for module in model.modules():
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.device != placement.device:
                module._buffers[key] = buffer.to(placement.device)
    if placement.precision != "fp32":
        model.forward = _autocast_forward(model.forward, placement)  # type: ignore[method-assign]
    if cfg.engine.gradient_checkpointing:
        enable_gradient_checkpointing(model, placement)


def _quantized(param: nn.Parameter) -> bool:
    """A bitsandbytes weight (4bit ``Params4bit``, 8bit ``Int8Params``): placed and typed by its loader."""
    return type(param).__module__.startswith("bitsandbytes")


def _autocast_forward(forward: Callable[..., Any], placement: Placement) -> Callable[..., Any]:
    @functools.wraps(forward)  # transformers reads forward's signature (generate's argument checks)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with placement.autocast():
            return forward(*args, **kwargs)

    return autocast_forward


def enable_gradient_checkpointing(model: nn.Module, placement: Placement) -> None:
    """Activation checkpointing of the transformers model inside ``model`` (non-reentrant: frozen
    embeddings need no input gradients, and dropout's RNG is replayed).

    The forward recomputed in backward runs outside the forward's autocast wrapper: torch's checkpoint
    restores the autocast state but not the attention-kernel switches, so the placement's
    :meth:`Placement.attention_kernels` is entered again around each recompute (``context_fn``)."""
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None or not inner.supports_gradient_checkpointing:
        name = type(inner or model).__name__
        raise ConfigError("engine.gradient_checkpointing", f"{name} does not support gradient checkpointing")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if placement.keeps_attention_off_cudnn:
        kwargs["context_fn"] = lambda: (nullcontext(), placement.attention_kernels())
    inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def configure_determinism(engine: EngineConfig, device: torch.device) -> None:
    """``engine.deterministic`` on CUDA: deterministic kernels only (cuBLAS needs a fixed workspace)."""
    if engine.deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
