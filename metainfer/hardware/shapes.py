"""The shape of a decoder-only LLM as the planner needs it: sizes, attention kind (GQA or
MLA, optionally with a DSA indexer), MoE layout and weight precision, read from a models/
config or a Hugging Face config (an object, or a config.json path). No weights anywhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int  # GQA key/value heads (MLA: = heads; its cache is one latent per token)
    head_dim: int  # GQA head dim
    intermediate: int  # dense MLP width
    max_context: int  # the model's position limit
    # MLA (DeepSeek): kv_lora_rank > 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DSA indexer (DeepSeek-V3.2): index_heads > 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # MoE: experts > 0; the first `dense_layers` layers use the dense MLP
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # width of the shared expert(s) together
    dense_layers: int = 0
    weight_bytes: float = 2.0  # per GEMM weight element (bf16 2, FP8 1 + block scales)
    act_bytes: int = 2  # activations and KV cache (bf16)

    # -- derived -----------------------------------------------------------------------
    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    def attention_params(self) -> dict[str, int]:
        """Weights of one attention block, split into what tensor parallelism shards (by heads)
        and what every rank keeps whole."""
        h, H = self.hidden, self.heads
        if self.mla:
            q_in = self.q_lora_rank or h  # q_b reads the q latent; without one, wq reads h
            sharded = (q_in * H * self.qk_dim + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
                       + H * self.v_head_dim * h)
            whole = h * self.q_lora_rank + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            if self.index_heads:  # the DSA indexer's q, k and head weights
                whole += q_in * self.index_heads * self.index_head_dim + h * self.index_head_dim + h * self.index_heads
            return {"sharded": sharded, "whole": whole}
        return {"sharded": h * (H + 2 * self.kv_heads) * self.head_dim + H * self.head_dim * h, "whole": 0}

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        """One routed expert."""
        return 3 * self.hidden * self.expert_intermediate

    def params(self) -> float:
        att = self.attention_params()
        per_layer_att = att["sharded"] + att["whole"]
        dense = self.layers - self.moe_layers
        total = self.layers * per_layer_att + dense * self.mlp_params()
        total += self.moe_layers * (self.experts * self.expert_params() + 3 * self.hidden * self.shared_intermediate
                                    + self.hidden * self.experts)
        return total + 2 * self.vocab * self.hidden

    def kv_bytes_per_token(self) -> float:
        """KV cache of one token over all layers, unsharded."""
        if self.mla:
            per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * self.act_bytes
            per_layer += self.index_head_dim * self.act_bytes if self.index_heads else 0
        else:
            per_layer = 2 * self.kv_heads * self.head_dim * self.act_bytes
        return self.layers * per_layer

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params()}

    def __str__(self) -> str:
        kind = "MLA" + (" + DSA" if self.index_heads else "") if self.mla else f"GQA {self.heads}/{self.kv_heads}"
        moe = (f", MoE {self.experts} experts top-{self.experts_per_token} x {self.expert_intermediate}"
               if self.moe else "")
        prec = "FP8" if self.weight_bytes < 2 else "bf16"
        return (f"{self.name}: {self.params() / 1e9:.1f}B parameters ({prec} weights), {self.layers} layers, "
                f"hidden {self.hidden}, {kind}{moe}")


# FP8 block scales: one float32 per 128 x 128 block
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)


def from_models(name_or_config) -> ModelShape:
    """The shape of a models/ config (a name from metainfer.models.names() or a config object)."""
    from metainfer import models
    from metainfer.models.deepseek import DeepSeekConfig
    from metainfer.models.llama import LlamaConfig

    name = name_or_config if isinstance(name_or_config, str) else type(name_or_config).__name__
    cfg = models.config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if isinstance(cfg, LlamaConfig):
        return ModelShape(name=name, hidden=cfg.dim, layers=cfg.n_layers, vocab=cfg.vocab_size, heads=cfg.n_heads,
                          kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.ffn_dim,
                          max_context=cfg.max_seq_len)
    if isinstance(cfg, DeepSeekConfig):
        return ModelShape(
            name=name, hidden=cfg.dim, layers=cfg.n_layers, vocab=cfg.vocab_size, heads=cfg.n_heads,
            kv_heads=cfg.n_heads, head_dim=cfg.qk_head_dim, intermediate=cfg.inter_dim, max_context=cfg.max_seq_len,
            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, index_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, experts=cfg.n_routed_experts,
            experts_per_token=cfg.n_activated_experts, expert_intermediate=cfg.moe_inter_dim,
            shared_intermediate=cfg.n_shared_experts * cfg.moe_inter_dim, dense_layers=cfg.n_dense_layers,
            weight_bytes=FP8_BLOCK_BYTES if cfg.fp8 else 2.0)
    raise TypeError(f"not a models/ config: {type(cfg).__name__}")


def read_config_json(path: "str | Path") -> tuple[Path, dict[str, Any]]:
    """(the file, its contents) of a Hugging Face config.json or the folder holding one; a
    ValueError naming the file and the place where it is not a config."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a config object")
    if "model_type" not in data:
        raise ValueError(f"{path} has no \"model_type\": not a Hugging Face model config")
    return path, data


def from_hf(config) -> ModelShape:
    """The shape of a Hugging Face config (object, dict, or path to config.json / its folder):
    Llama-like dense models, DeepSeek-V3/V3.2 (MLA, MoE), Mixtral/Qwen-MoE-style MoE."""
    if isinstance(config, (str, Path)):
        path, data = read_config_json(config)
        name = data.get("_name_or_path") or path.parent.name or path.stem
    elif isinstance(config, dict):
        data, name = dict(config), config.get("_name_or_path", "hf-config")
    else:
        data, name = config.to_dict(), getattr(config, "name_or_path", "") or type(config).__name__
    name = name or data.get("model_type", "hf-config")

    def need(*keys):
        for k in keys:
            if data.get(k) is not None:
                return data[k]
        raise ValueError(f"Hugging Face config {name!r} has none of {keys}: cannot tell the model's shape")

    hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = data.get("num_key_value_heads") or heads
    head_dim = data.get("head_dim") or hidden // heads
    quant = data.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8" or "float8" in str(quant.get("fmt", ""))
    common = dict(name=str(name), hidden=hidden, layers=layers, vocab=need("vocab_size"), heads=heads,
                  max_context=data.get("max_position_embeddings") or 4096, weight_bytes=FP8_BLOCK_BYTES if fp8 else 2.0)
    experts = data.get("n_routed_experts") or data.get("num_local_experts") or data.get("num_experts") or 0
    moe = {}
    if experts:
        shared = data.get("shared_expert_intermediate_size") or (
            (data.get("n_shared_experts") or 0) * (data.get("moe_intermediate_size") or 0))
        moe = dict(experts=experts, experts_per_token=need("num_experts_per_tok"),
                   expert_intermediate=data.get("moe_intermediate_size") or need("intermediate_size"),
                   shared_intermediate=shared, dense_layers=data.get("first_k_dense_replace") or 0)
    if data.get("kv_lora_rank"):
        return ModelShape(**common, kv_heads=heads, head_dim=need("qk_nope_head_dim") + need("qk_rope_head_dim"),
                          intermediate=need("intermediate_size"), q_lora_rank=data.get("q_lora_rank") or 0,
                          kv_lora_rank=data["kv_lora_rank"], qk_nope_head_dim=data["qk_nope_head_dim"],
                          qk_rope_head_dim=data["qk_rope_head_dim"], v_head_dim=need("v_head_dim"),
                          index_heads=data.get("index_n_heads") or 0, index_head_dim=data.get("index_head_dim") or 0,
                          index_topk=data.get("index_topk") or 0, **moe)
    return ModelShape(**common, kv_heads=kv_heads, head_dim=head_dim, intermediate=need("intermediate_size"), **moe)


def resolve(model) -> ModelShape:
    """A ModelShape from a ModelShape, a models/ name or config, or a Hugging Face config
    (object, dict or config.json path)."""
    if isinstance(model, ModelShape):
        return model
    from metainfer import models

    if isinstance(model, str) and model in models.names():
        return from_models(model)
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir() or path.suffix == ".json" or path.exists():
            return from_hf(path)
        raise ValueError(f"model {str(model)!r} is neither a models/ name ({', '.join(models.names())}) nor a "
                         "Hugging Face config.json")
    try:
        return from_models(model)
    except TypeError:
        return from_hf(model)
