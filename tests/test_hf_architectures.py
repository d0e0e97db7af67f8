"""scheduler.checkpoint across Hugging Face architectures, as a user brings them: tiny configs
from each model type's own defaults (random weights, dropout on, the KV cache on as every
pretrained causal LM's config has it). For each: the block list is found, the profiling step
runs, then a plan at a budget near rotor's smallest that really recomputes; losses and
gradients are bit-identical (torch.equal) to plain training without the cache, which is what
any checkpointed training runs (HF's own checkpointing turns the cache off too; with it on,
OPT, GPT-J, CodeGen and MPT sum some gradients in another order: 1-ulp differences in plain
training itself).

A model type the installed transformers does not know is skipped, saying so: the list names
types of transformers 5.x; CI installs the newest."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners import rotor
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime.checkpoint import checkpointed

from wrap_models import one_thread  # noqa: F401  (autouse fixture)

import transformers  # a test dependency (pyproject [test]): never skip silently
transformers.logging.set_verbosity_error()

VOCAB = 64
FAST = {"repeat": 1, "warmup": 0}
CAUSAL = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
          "gemma2", "gemma3_text", "phi", "phi3", "opt", "gpt_neox", "falcon", "bloom", "gptj",
          "codegen", "mpt", "gpt_bigcode", "olmo", "olmo2", "stablelm", "starcoder2", "cohere",
          "granite", "deepseek_v3", "gpt_oss", "smollm3"]
MASKED = ["roberta", "distilbert", "electra", "deberta-v2", "xlm-roberta", "modernbert"]
SEQ2SEQ = ["bart", "mbart", "pegasus", "blenderbot"]   # an encoder list and a decoder list
LAYERDROP = ["m2m_100"]   # seq2seq too, skipping blocks at random by default
IMAGES = ["vit", "dinov2", "beit", "convnext", "resnet"]   # classification: stages for CNNs
# one size per idea, under each name a config type uses for it
SIZES = {"hidden_size": 32, "n_embd": 32, "d_model": 32, "dim": 32, "embedding_size": 32,
         "word_embed_proj_dim": 32, "num_hidden_layers": 3, "n_layer": 3, "n_layers": 3,
         "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "intermediate_size": 64, "hidden_dim": 64, "ffn_dim": 64,
         "n_inner": 64, "rotary_dim": 4, "vocab_size": VOCAB, "max_position_embeddings": 64,
         "n_positions": 64, "max_seq_len": 64,
         # mixtures of experts: 4 experts, 2 per token
         "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
         "topk_group": 1,
         # DeepSeek's latent attention
         "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
         "v_head_dim": 8,
         # encoder-decoders
         "encoder_layers": 3, "decoder_layers": 3, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
         "decoder_start_token_id": 0,
         # images: 32x32, patches of 8; CNNs: three stages of one block
         "image_size": 32, "patch_size": 8, "num_labels": 5, "embed_dim": 16,
         "depths": [1, 1, 1], "hidden_sizes": [16, 16, 16], "num_stages": 3}
SPECIAL = {"deepseek_v3": {"head_dim": 4}}  # its rotary dims are qk_rope_head_dim's
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout",
            "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")
TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def config(model_type: str) -> Any:
    try:
        cfg = transformers.AutoConfig.for_model(model_type)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    wanted = dict(SIZES, **SPECIAL.get(model_type, {}))
    for key, value in wanted.items():
        if hasattr(cfg, key):
            try:
                setattr(cfg, key, value)
            except AttributeError:  # derived from the others (Falcon's head_dim)
                pass
    for key in DROPOUTS:
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.1)
    for key, value in TOKENS.items():
        setattr(cfg, key, value)
    cfg.use_cache = True
    return cfg


def build(model_type: str) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """The model in training mode, a batch, and the batch plain training runs to compare
    (without the KV cache where the model has one)."""
    torch.manual_seed(0)
    cfg = config(model_type)
    ids = torch.randint(2, VOCAB, (2, 12))
    if model_type in IMAGES:
        model = transformers.AutoModelForImageClassification.from_config(cfg)
        batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 3])}
        return model.train(), batch, batch
    if model_type in MASKED:
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0  # padding: the mask really matters
        model = transformers.AutoModelForMaskedLM.from_config(cfg)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
        return model.train(), batch, batch
    if model_type in SEQ2SEQ + LAYERDROP:
        model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
        batch = {"input_ids": ids, "labels": ids[:, :7].contiguous()}
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        batch = {"input_ids": ids, "labels": ids}
    return model.train(), batch, dict(batch, use_cache=False)


def step(model: nn.Module, batch: Dict[str, Any], seed: int) -> Tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def assert_same(want: Tuple[torch.Tensor, list], got: Tuple[torch.Tensor, list],
                names: list, what: str) -> None:
    assert torch.equal(want[0], got[0]), f"{what}: loss {want[0].item()} != {got[0].item()}"
    for name, a, b in zip(names, want[1], got[1]):
        assert (a is None) == (b is None), f"{what}: {name} grad presence"
        assert a is None or torch.equal(a, b), f"{what}: {name} grad differs"


@pytest.mark.parametrize("model_type", CAUSAL + MASKED + SEQ2SEQ + IMAGES)
def test_checkpoint_bit_identical(model_type):
    ref, batch, plain = build(model_type)
    model = copy.deepcopy(ref)
    names = [n for n, _ in ref.named_parameters()]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scheduler.checkpoint(model, "1TiB", "rotor", measure_options=FAST)
        for seed in range(2):  # profiling step, then a plan that keeps everything
            assert_same(step(ref, plain, seed), step(model, batch, seed), names,
                        f"{model_type} step {seed}")
        runners = checkpointed(model).runners
        want = 2 if model_type in SEQ2SEQ else 1
        assert [r.L for r in runners] == [3] * want, "not the config's block lists"
        # just above rotor's smallest budget on the measured chains (shared by block count)
        low = max(rotor.min_memory(r.last_plan.chain) for r in runners) * want
        scheduler.checkpoint(model, int(low * 1.1), "rotor", measure_options=FAST)
        for seed in range(2, 5):  # profiling step, then the plan twice
            assert_same(step(ref, plain, seed), step(model, batch, seed), names,
                        f"{model_type} rotor step {seed}")
        assert all(r.last_plan.planner == "rotor" for r in checkpointed(model).runners)
        # every block recomputed (the CNNs' smallest budget keeps them all: a backward's
        # temporaries in the first stage set their peak)
        scheduler.checkpoint(model, None, plan_from_checkpoints(3, [0, 1, 2]))
        for seed in range(5, 7):
            assert_same(step(ref, plain, seed), step(model, batch, seed), names,
                        f"{model_type} all recomputed step {seed}")
        assert all(r.last_stats.recomputed_forwards == 3 for r in checkpointed(model).runners)
    # nothing measured with a stand-in (the model's tail, stage L, included), nothing else said
    # but that the profiling step at rotor's smallest budget holds more than it (it measures
    # a block's weight gradients at once: true of these tiny blocks, whose weights dwarf their
    # activations)
    ours = [str(w.message) for w in said if str(w.message).startswith("scheduler.")]
    assert all("without their KV cache" in m or "the first step of each new input shape" in m
               for m in ours), ours
    for runner in runners:
        meta = runner.last_plan.chain.meta
        assert "failed" not in meta.get("tail", {}), meta




@pytest.mark.parametrize("planner", ["rotor", "mimose"])
@pytest.mark.parametrize("model_type, asked", [
    ("mixtral", {"output_router_logits": True}),   # the load-balancing loss joins the loss
    ("llama", {"output_hidden_states": True, "output_attentions": True})])
def test_captured_outputs_are_the_models_own(model_type, asked, planner):
    """transformers 5 collects hidden states, attentions and MoE router logits with hooks
    while the model's forward runs; the runner's own block calls in that forward (measuring
    the chain, Mimose's collection) must not join them: the same outputs as plain training,
    as many, and the router loss's backward through the right graphs."""
    ref, batch, plain = build(model_type)
    ref.config.router_aux_loss_coef = 0.5
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1TiB", planner,
                         **({} if planner == "mimose" else {"measure_options": FAST}))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        for seed in range(4):  # profiling (or collection) steps, then plans
            outs = []
            for m, b in ((ref, dict(plain, **asked)), (model, dict(batch, **asked))):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                out = m(**b)
                out.loss.backward()
                outs.append((out, [p.grad for p in m.parameters()]))
            (want, want_grads), (got, got_grads) = outs
            names = [n for n, _ in ref.named_parameters()]
            assert_same((want.loss, want_grads), (got.loss, got_grads), names, f"step {seed}")
            for key in ("hidden_states", "attentions", "router_logits"):
                a, b = getattr(want, key, None), getattr(got, key, None)
                assert (a is None) == (b is None), key
                if a is not None:
                    assert len(a) == len(b), f"step {seed}: {len(b)} {key}, plain has {len(a)}"
                    assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {seed}: {key}"

def whisper() -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    cfg = transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32, vocab_size=VOCAB, dropout=0.1,
        decoder_start_token_id=0, **TOKENS)
    batch = {"input_features": torch.randn(2, 16, 32),
             "labels": torch.randint(2, VOCAB, (2, 6))}
    return transformers.WhisperForConditionalGeneration(cfg), batch, dict(batch, use_cache=False)


def wav2vec2() -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    # its default LayerDrop (0.1) is refused (test below): 0 here
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, vocab_size=16, layerdrop=0.0, hidden_dropout=0.1,
        mask_time_prob=0.0)
    batch = {"input_values": torch.randn(2, 1600), "labels": torch.randint(1, 16, (2, 5))}
    return transformers.Wav2Vec2ForCTC(cfg), batch, batch


def clip() -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    tower = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, dropout=0.1)
    cfg = transformers.CLIPConfig(
        text_config=dict(tower, vocab_size=VOCAB, max_position_embeddings=16),
        vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=16)
    batch = {"input_ids": torch.randint(1, VOCAB, (2, 8)),
             "pixel_values": torch.randn(2, 3, 32, 32), "return_loss": True}
    return transformers.CLIPModel(cfg), batch, batch


@pytest.mark.parametrize("make", [whisper, wav2vec2, clip], ids=lambda f: f.__name__)
def test_speech_and_two_towers(make):
    """Two block lists each: Whisper's encoder and decoder, wav2vec2's convolutional feature
    extractor and transformer encoder, CLIP's text and vision towers (one loss over both)."""
    torch.manual_seed(0)
    ref, batch, plain = make()
    ref.train()
    model = copy.deepcopy(ref)
    names = [n for n, _ in ref.named_parameters()]
    # transformers 4.4x's feature extractor has no GradientCheckpointingLayers to find it by
    blocks = (["wav2vec2.feature_extractor.conv_layers", "wav2vec2.encoder.layers"]
              if make is wav2vec2 else None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        scheduler.checkpoint(model, "1TiB", "rotor", blocks, measure_options=FAST)
        for seed in range(2):
            assert_same(step(ref, plain, seed), step(model, batch, seed), names, f"step {seed}")
        assert [r.L for r in checkpointed(model).runners] == [2, 2]
        scheduler.checkpoint(model, None, plan_from_checkpoints(2, [0, 1]), blocks)
        for seed in range(2, 4):
            assert_same(step(ref, plain, seed), step(model, batch, seed), names, f"step {seed}")
    assert all(r.last_stats.recomputed_forwards == 2 for r in checkpointed(model).runners)

def test_layerdrop_refused_naming_where():
    """LayerDrop (M2M100 and NLLB's default, wav2vec2's) skips blocks at random in training,
    which no plan over every block can follow: refused at the call, naming each place that
    holds a probability above 0; with them at 0 the model trains as plain training does."""
    ref, batch, plain = build("m2m_100")
    model = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="LayerDrop.*set each to 0") as refused:
        scheduler.checkpoint(model, "1TiB")
    for where in ("model.model.encoder.layerdrop=0.05", "model.model.decoder.layerdrop=0.05"):
        assert where in str(refused.value)
    assert checkpointed(model) is None
    # only the lists checkpointed count: the encoder's alone, with the decoder's LayerDrop on
    with pytest.raises(ValueError, match=r"LayerDrop: model\.model\.encoder\.layerdrop=0\.05\)"):
        scheduler.checkpoint(model, "1TiB", blocks="model.encoder.layers")
    model.model.encoder.layerdrop = 0.0
    scheduler.checkpoint(model, "1TiB", blocks="model.encoder.layers")
    for m in (ref, model):
        m.model.encoder.layerdrop = m.model.decoder.layerdrop = 0.0
    scheduler.checkpoint(model, None, plan_from_checkpoints(3, [0, 1, 2]))
    names = [n for n, _ in ref.named_parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        for seed in range(2):
            assert_same(step(ref, plain, seed), step(model, batch, seed), names, f"step {seed}")
