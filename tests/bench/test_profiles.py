"""Deployment profiles: the shipped data loads, shapes give the published byte sizes, a bad file
names its field, and time scaling sets the link so the bundled model has the profile's R."""

import json
from importlib import resources

import pytest

from pdflash.bench.profiles import ProfileError, TimeScale, get_profile, load_profiles

SHIPPED = (
    "qwen3-30b-a3b@h200-pcie5",
    "qwen3-coder-30b-a3b@h200-pcie5",
    "gpt-oss-20b@h200-pcie5",
    "gpt-oss-120b@h200-pcie5",
)


def test_the_shipped_profiles_load_with_their_sources():
    profiles = load_profiles()
    for name in SHIPPED:
        p = profiles[name]
        assert p.model.source.startswith("https://huggingface.co/")
        assert p.link.source and p.accelerator.source


def test_qwen3_expert_bytes_are_three_bf16_matrices():
    m = get_profile("qwen3-30b-a3b@h200-pcie5").model
    assert m.expert_bytes == 3 * 2048 * 768 * 2  # gate, up [768, 2048] and down [2048, 768] in bf16
    assert m.token_routed_bytes == 48 * 8 * 3 * 2048 * 768 * 2


def test_gpt_oss_expert_bytes_are_mxfp4_blocks_scales_and_biases():
    m = get_profile("gpt-oss-120b@h200-pcie5").model
    H = I = 2880
    # per expert, from the checkpoint's tensor shapes: *_blocks [rows, cols/32, 16] uint8,
    # *_scales [rows, cols/32] uint8, *_bias [rows] bf16
    gate_up = 2 * I * (H // 32) * 16 + 2 * I * (H // 32) + 2 * I * 2
    down = H * (I // 32) * 16 + H * (I // 32) + H * 2
    assert m.expert_bytes == gate_up + down == 13_236_480


def test_the_qwen3_pcie5_regime_is_link_bound_by_about_14():
    p = get_profile("qwen3-30b-a3b@h200-pcie5")
    assert p.token_fetch_s == pytest.approx(3_623_878_656 / 57.6e9)
    assert p.regime_ratio == pytest.approx(p.token_fetch_s / p.ar_step_s)
    assert 13 < p.regime_ratio < 15  # ARCHITECTURE.md: 63 ms over ~4.5 ms


def _profile_file(tmp_path, **edits):
    data = json.loads((resources.files("pdflash.bench") / "profiles.json").read_text())
    for dotted, value in edits.items():
        *path, last = dotted.split("/")
        node = data
        for key in path:
            node = node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"models/gpt-oss-20b/num_experts": None}, "models.gpt-oss-20b.num_experts is missing"),
        ({"models/gpt-oss-20b/hidden_size": "2880"}, "models.gpt-oss-20b.hidden_size='2880' must be of type int"),
        ({"links/pcie5/h2d_bytes_per_s": -1}, "links.pcie5.h2d_bytes_per_s=-1 must be > 0"),
        ({"models/gpt-oss-20b/expert_format": "fp4"}, "models.gpt-oss-20b.expert_format='fp4' is not one of"),
        ({"profiles/gpt-oss-20b@h200-pcie5/link": "nvlink"}, "profiles.gpt-oss-20b@h200-pcie5.link='nvlink'"),
        ({"accelerators/h200/hbm_tb": 4.8}, "accelerators.h200 has unknown field(s) ['hbm_tb']"),
        ({"models/gpt-oss-20b/num_experts_per_tok": 64}, "num_experts_per_tok=64 exceeds num_experts=32"),
    ],
)
def test_a_bad_profile_file_names_the_field(tmp_path, edit, named):
    with pytest.raises(ProfileError) as info:
        load_profiles(_profile_file(tmp_path, **edit))
    assert named in str(info.value)


def test_an_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ProfileError, match="'h100' is unknown; choose one of .*qwen3-30b-a3b@h200-pcie5"):
        get_profile("h100")


def test_time_scaling_gives_the_model_here_the_profile_regime():
    p = get_profile("qwen3-30b-a3b@h200-pcie5")
    bundled_token_bytes = 4 * 4 * 3 * 256 * 64 * 2  # 4 MoE layers x top-4 x one fp16 expert
    scale = TimeScale.for_profile(p, ar_step_s=0.004, token_routed_bytes=bundled_token_bytes)
    fetch_s = bundled_token_bytes / (scale.link_gbps * 1e9)
    assert fetch_s / 0.004 == pytest.approx(p.regime_ratio)
    assert scale.cache_fraction == pytest.approx(24e9 / (48 * 128 * 9_437_184))
    assert "R = 14.0" in scale.describe()
    with pytest.raises(ValueError, match="positive AR step"):
        TimeScale.for_profile(p, ar_step_s=0.0, token_routed_bytes=bundled_token_bytes)


def test_the_roofline_step_is_fixed_cost_plus_hbm_time(tmp_path):
    p = get_profile("gpt-oss-20b@h200-pcie5")
    m, a = p.model, p.accelerator
    read = m.dense_bytes_per_forward + m.num_hidden_layers * m.num_experts_per_tok * m.expert_bytes
    assert p.ar_step_s == pytest.approx(m.num_hidden_layers * a.per_layer_fixed_s + read / a.hbm_bytes_per_s)
