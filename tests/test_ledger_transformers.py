"""transformers 5 under the write ledger: decoders, encoders, vision and audio models and MoE, each built from a small
config on the meta device, ``to_empty``, and initialized by the library's own ``init_weights()``; and
``save_pretrained`` then ``from_pretrained``. What the ledger finds unwritten in transformers itself is listed in
FINDINGS and in ``docs/ledger.rst``: the tests check that it finds exactly that, and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modattrs.ledger import Report, watch

transformers = pytest.importorskip("transformers")

DECODER = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64, "head_dim": 8, "pad_token_id": 0,
}  # fmt: skip
MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4}
MOE |= {"num_experts_per_tok": 2, "shared_expert_intermediate_size": 32}
ENCODER_DECODER = {
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 128, "pad_token_id": 0,
    "max_position_embeddings": 64,
}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
VISION |= {"image_size": 32, "patch_size": 8}


def small(config_name: str, **sizes: Any) -> Callable[[], Any]:
    """The config ``config_name`` with each of ``sizes`` it has."""

    def make() -> Any:
        config_class = getattr(transformers, config_name)
        defaults = config_class()
        return config_class(**{key: value for key, value in sizes.items() if hasattr(defaults, key)})

    return make


def clip_config() -> Any:
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    vision = {**text, "image_size": 32, "patch_size": 8}
    return transformers.CLIPConfig(
        text_config={**text, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config=vision,
        projection_dim=16,
    )


#: Architecture (the model class) -> its small config.
ARCHITECTURES: dict[str, Callable[[], Any]] = {
    # decoders
    "LlamaForCausalLM": small("LlamaConfig", **DECODER),
    "MistralForCausalLM": small("MistralConfig", **DECODER),
    "Qwen2ForCausalLM": small("Qwen2Config", **DECODER),
    "Qwen3ForCausalLM": small("Qwen3Config", **DECODER),
    "GemmaForCausalLM": small("GemmaConfig", **DECODER),
    "Gemma2ForCausalLM": small("Gemma2Config", **DECODER),
    "Gemma3ForCausalLM": small("Gemma3TextConfig", **DECODER),
    "Phi3ForCausalLM": small("Phi3Config", **DECODER),
    "GPT2LMHeadModel": small("GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128),
    "GPTNeoXForCausalLM": small("GPTNeoXConfig", **DECODER),
    "OPTForCausalLM": small("OPTConfig", **DECODER, ffn_dim=64, word_embed_proj_dim=32),
    "Olmo2ForCausalLM": small("Olmo2Config", **DECODER),
    "StableLmForCausalLM": small("StableLmConfig", **DECODER),
    "Starcoder2ForCausalLM": small("Starcoder2Config", **DECODER),
    # encoders, encoder-decoders
    "BertForMaskedLM": small("BertConfig", **DECODER),
    "RobertaForMaskedLM": small("RobertaConfig", **{**DECODER, "pad_token_id": 1}),
    "DistilBertForMaskedLM": small("DistilBertConfig", dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=128),
    "ElectraForPreTraining": small("ElectraConfig", **DECODER, embedding_size=32),
    "DebertaV2ForMaskedLM": small("DebertaV2Config", **DECODER),
    "T5ForConditionalGeneration": small(
        "T5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=128
    ),
    "BartForConditionalGeneration": small("BartConfig", **ENCODER_DECODER),
    # vision, audio, multimodal
    "ViTForImageClassification": small("ViTConfig", **VISION),
    "Dinov2Model": small("Dinov2Config", **VISION),
    "ConvNextForImageClassification": small("ConvNextConfig", hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
    "Wav2Vec2ForCTC": small("Wav2Vec2Config", **VISION, vocab_size=32),
    "CLIPModel": clip_config,
    # mixtures of experts
    "MixtralForCausalLM": small("MixtralConfig", **DECODER, **MOE),
    "Qwen2MoeForCausalLM": small("Qwen2MoeConfig", **DECODER, **MOE),
    "Qwen3MoeForCausalLM": small("Qwen3MoeConfig", **DECODER, **MOE),
    "OlmoeForCausalLM": small("OlmoeConfig", **DECODER, **MOE),
    "DeepseekV3ForCausalLM": small(
        "DeepseekV3Config",
        **DECODER,
        **MOE,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "GptOssForCausalLM": small("GptOssConfig", **DECODER, **MOE),
}

#: What the ledger finds left unwritten by transformers' own init_weights() after meta + to_empty, by architecture;
#: docs/ledger.rst says why for each.
FINDINGS: dict[str, set[str]] = {
    "CLIPModel": {"logit_scale"},
    "Wav2Vec2ForCTC": {
        "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original0",
        "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original1",
    },
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    return None


def meta_to_empty_init_weights(name: str) -> tuple[nn.Module, Report]:
    config = ARCHITECTURES[name]()
    with watch() as ledger:
        with torch.device("meta"):
            model = getattr(transformers, name)._from_config(config)
        model.to_empty(device="cpu")
        model.init_weights()
    return model, ledger.report(model)


def test_the_architectures_are_at_least_twenty_of_every_kind() -> None:
    assert len(ARCHITECTURES) >= 20
    assert sum("Moe" in name or name.startswith(("Mixtral", "Deepseek", "GptOss")) for name in ARCHITECTURES) >= 5


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_transformers_init_weights_after_to_empty_leaves_only_the_documented_findings_unwritten(name: str) -> None:
    model, report = meta_to_empty_init_weights(name)
    assert {entry.name for entry in report.problems} == FINDINGS.get(name, set())
    assert all(entry.status == "unwritten" for entry in report.problems)
    assert report.broken_ties == []  # init_weights() ties again what to_empty broke
    assert len(report.entries) == len(list(model.named_parameters(remove_duplicate=False))) + len(
        list(model.named_buffers(remove_duplicate=False))
    )
    assert {entry.status for entry in report} <= {"initialized", "computed", "tied", "unwritten"}


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_each_finding_is_written_by_eager_construction(name: str) -> None:
    config = ARCHITECTURES[name]()
    with watch() as ledger:
        model = getattr(transformers, name)._from_config(config)
    report = ledger.report(model)
    report.check()
    assert {report[finding].status for finding in FINDINGS[name]} <= {"initialized", "computed"}


def test_the_clip_finding_is_garbage_where_eager_construction_has_the_configured_value() -> None:
    _, report = meta_to_empty_init_weights("CLIPModel")
    assert report["logit_scale"].ranges("unwritten") == ((0, 4),)
    eager = transformers.CLIPModel(clip_config())
    assert eager.logit_scale.item() == pytest.approx(2.6592)


@pytest.mark.parametrize(
    "name", ["LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2MoeForCausalLM", "T5ForConditionalGeneration"]
)
def test_from_pretrained_of_a_saved_model_loads_every_parameter_under_its_checkpoint_keys(
    name: str, tmp_path: Path
) -> None:
    getattr(transformers, name)._from_config(ARCHITECTURES[name]()).save_pretrained(tmp_path)
    with watch() as ledger:
        model = getattr(transformers, name).from_pretrained(tmp_path)
    report = ledger.report(model)
    report.check()
    for entry in report:
        if entry.role == "parameter" and entry.status != "tied":
            assert entry.status == "loaded", entry
            # the checkpoint's keys: the tensor's own, or (experts merged by cat/stack) those of its module's parts
            assert f"'{entry.name.rpartition('.')[0]}." in entry.parts[0].what, entry
    assert {entry.status for entry in report if entry.role != "parameter"} <= {"computed", "initialized", "tied"}
