"""Dense attention beside DSA: ``attention.dense_blocks``, ``attention.dense_above_t`` and the
dense-to-sparse curriculum ``attention.dense_warmup_steps`` (``models/attention_levers.py``).

Each lever is held against the models it must equal, built from the same (randomised) weights:
the dense model (``attention.kind = dense``) and the DSA model without the lever, to the bit
(every block computes the same operations on the samples it runs); the streamed trainer with
each lever against the in-process trainer; and the config refusals.
"""

import math

import pytest
import torch
from helpers import assert_streamed_equals_in_process, demo_batches, masters, streamed, train_steps

from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.models.attention import dense_attention, self_attention
from megaslide_ray.models import attention_levers
from megaslide_ray.models.attention_levers import dense_weight, host_weights, step_mix, weights_on_host
from megaslide_ray.models.registry import build_model
from megaslide_ray.training.baseline import InProcessTrainer

VIDEODIT = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
            "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
            "attention.max_offset": 1.5}
WAN = {"model.arch": "wan", "model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.ffn_dim": 48,
       "model.in_channels": 4, "model.patch_size": "1,2,2", "model.text_dim": 12, "model.text_len": 8,
       "model.timestep_freq_dim": 16, "data.num_frames": 9, "data.height": 48, "data.width": 80,
       "attention.kind": "dsa", "attention.window": "3,3,3", "attention.max_offset": 1.5}


def _cfg(arch: str, **extra):
    return build_config("tiny", None, {**(VIDEODIT if arch == "videodit" else WAN), **extra})


def _models(arch: str, seed: int = 0, **extra) -> tuple:
    """The model with ``extra`` (every weight randomised, offsets large) and the dense and DSA
    models with the same weights (the dense one without the offset heads)."""
    model = build_model(_cfg(arch, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 if ".offsets.out." in name else 0.1))
    dense, dsa = build_model(_cfg(arch, **{"attention.kind": "dense"})), build_model(_cfg(arch))
    state = model.state_dict()
    for other in (dense, dsa):
        missing, unexpected = other.load_state_dict(state, strict=False)
        assert all(".offsets." in n for n in missing + unexpected), (missing, unexpected)
        with torch.no_grad():  # offset heads model lacks (its dense blocks): random too, they must not matter
            for n, p in other.named_parameters():
                if n in missing:
                    p.copy_(torch.randn(p.shape, generator=g))
    return model, dense, dsa


def _inputs(arch: str, t):
    g = torch.Generator().manual_seed(3)
    B = len(t)
    if arch == "videodit":
        cap = torch.randint(1, 255, (B, 8), generator=g, dtype=torch.uint8)
        return (torch.randn(B, 6, 32, 32, 3, generator=g), torch.tensor(t), cap, torch.tensor([5] * B))
    cfg = _cfg(arch)
    F, H, W = cfg.latent_grid
    return (torch.randn(B, F, H, W, 4, generator=g), torch.tensor(t), torch.randn(B, 5, 12, generator=g),
            torch.tensor([3] * B))


def _run(model, args, **kw):
    """Output and every parameter's gradient (by name) of ``sum(out * dy)``."""
    model.zero_grad(set_to_none=True)
    out = model(*args, **kw)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


ARCHS = ["videodit", "wan"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_block_dense_is_the_dense_model(arch):
    model, dense, _ = _models(arch, **{"attention.dense_blocks": "0,1"})
    assert not any(".offsets." in n for n, _ in model.named_parameters())  # a dense block has no offset head
    args = _inputs(arch, [0.3, 0.7])
    out, grads = _run(model, args)
    want, want_grads = _run(dense, args)
    assert torch.equal(out, want)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], want_grads[n]), n


@pytest.mark.parametrize("arch", ARCHS)
def test_a_dense_block_among_dsa_blocks(arch):
    """Block 0 dense, block 1 DSA: each block is the dense model's, or the DSA model's."""
    model, dense, dsa = _models(arch, **{"attention.dense_blocks": "0"})
    names = {n.split(".offsets.")[0] for n, _ in model.named_parameters() if ".offsets." in n}
    assert names == {"blocks.1.attn" if arch == "videodit" else "blocks.1.attn1"}
    x, c = model.shards()[0](*_inputs(arch, [0.3, 0.7]))
    with torch.no_grad():
        assert torch.equal(model.blocks[0](x, c), dense.blocks[0](x, c))
        assert torch.equal(model.blocks[1](x, c), dsa.blocks[1](x, c))
        assert not torch.equal(dense.blocks[1](x, c), dsa.blocks[1](x, c))  # so the comparison tells


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_above_t_is_chosen_per_sample(arch):
    """t = 0.9 and t = 0.6 at or above 0.6: the dense model's outputs and gradients (summed over
    the batch, so compared per sample by running each model on each sample); t = 0.2: DSA's."""
    model, dense, dsa = _models(arch, **{"attention.dense_above_t": 0.6})
    args = _inputs(arch, [0.9, 0.2, 0.6])
    with torch.no_grad():
        out, want_dense, want_dsa = model(*args), dense(*args), dsa(*args)
    assert torch.equal(out[0], want_dense[0]) and torch.equal(out[2], want_dense[2])
    assert torch.equal(out[1], want_dsa[1])
    assert not torch.equal(want_dense[1], want_dsa[1])
    one = tuple(a[1:2] for a in args)  # a sample alone below the time: DSA's gradients too
    _, grads = _run(model, one)
    _, want = _run(dsa, one)
    for n in want:
        assert torch.equal(grads[n], want[n]), n
    off = build_model(_cfg(arch, **{"attention.dense_above_t": 0.0}))
    off.load_state_dict(dsa.state_dict())
    with torch.no_grad():  # 0: off, DSA for every t
        assert torch.equal(off(*args), want_dsa)


@pytest.mark.parametrize("arch", ARCHS)
def test_curriculum_ends_equal_dense_and_dsa(arch):
    """The trainer's dense weight 1 (step 0) is the dense model, 0 (the end) the DSA model."""
    model, dense, dsa = _models(arch, **{"attention.dense_warmup_steps": 4})
    args = _inputs(arch, [0.3, 0.7])
    out, grads = _run(model, args, dense_mix=torch.ones(2))
    want, want_grads = _run(dense, args)
    assert torch.equal(out, want)
    for n in want_grads:
        assert torch.equal(grads[n], want_grads[n]), n
    assert all(g is None for n, g in grads.items() if ".offsets." in n)  # unused (the trainers: a zero gradient)
    out, grads = _run(model, args)  # no weights given: the schedule's end, as sampling runs it
    want, want_grads = _run(dsa, args)
    assert torch.equal(out, want)
    for n in want_grads:
        assert torch.equal(grads[n], want_grads[n]), n


def test_curriculum_between_is_the_blend():
    """Weights 0, 1 and 0.3 in one batch: DSA's, dense's and ``0.3 dense + 0.7 dsa`` attention."""
    model, _, _ = _models("videodit", **{"attention.dense_warmup_steps": 4})
    attn = model.blocks[0].attn
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 3, 4, 4, 2, 16, generator=g) for _ in range(3))
    h = torch.randn(3, 3, 4, 4, 32, generator=g)
    with torch.no_grad():
        got = self_attention(attn, q, k, v, h, None, torch.tensor([0.0, 1.0, 0.3]))
        dsa = self_attention(attn, q, k, v, h)
    dense = dense_attention(q, k, v, attn.scale)
    assert torch.equal(got[0], dsa[0]) and torch.equal(got[1], dense[1])
    assert torch.allclose(got[2], 0.3 * dense[2] + 0.7 * dsa[2], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(dense[2], dsa[2], atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_token_chunked_blocks_blend_alike(arch):
    """``runtime.token_chunk``: the chunked block with mixed dense weights is the whole block's
    function (the chunk tests' 1e-6)."""
    model, _, _ = _models(arch, **{"attention.dense_warmup_steps": 4})
    chunked = build_model(_cfg(arch, **{"attention.dense_warmup_steps": 4, "runtime.token_chunk": 40}))
    chunked.load_state_dict(model.state_dict())
    args = _inputs(arch, [0.3, 0.7, 0.5])
    mix = torch.tensor([0.0, 1.0, 0.3])
    with torch.no_grad():
        want, got = model(*args, dense_mix=mix), chunked(*args, dense_mix=mix)
    assert float((got - want).norm() / want.norm()) < 1e-6


def test_dense_weights_follow_the_time_and_the_step():
    cfg = _cfg("videodit", **{"attention.dense_above_t": 0.8, "attention.dense_warmup_steps": 4})
    t = torch.tensor([0.9, 0.8, 0.5])
    assert dense_weight(cfg, t).tolist() == [1.0, 1.0, 0.0]
    assert dense_weight(cfg, t, 0).tolist() == [1.0, 1.0, 1.0]
    assert dense_weight(cfg, t, 3).tolist() == [1.0, 1.0, 0.25]
    assert dense_weight(cfg, t, 4).tolist() == [1.0, 1.0, 0.0]
    assert step_mix(cfg, t, 1)["dense_mix"].tolist() == [1.0, 1.0, 0.75]
    assert step_mix(cfg, t, 4) == {}  # after the warm-up shard 0 computes them from t
    assert step_mix(_cfg("videodit"), t, 0) == {}


def _no_device_read(mix):
    raise AssertionError(f"a block read its dense weights {mix.shape} back from the device")


@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_choose_by_the_host_weights_without_reading_the_device(arch, monkeypatch):
    """Inside ``weights_on_host`` a block takes each sample's kind from the host's weights (no
    read of ``c``'s column, a device sync on CUDA) and computes what it computes from the column;
    the weights are really used (wrong ones give another output), and must match the batch."""
    levers = {"attention.dense_above_t": 0.6, "attention.dense_warmup_steps": 4}
    model, _, _ = _models(arch, **levers)
    args = _inputs(arch, [0.9, 0.2, 0.6])
    mix = torch.tensor([1.0, 0.3, 0.0])  # dense, a blend, the block's kind
    with torch.no_grad():
        want_t, want_mix = model(*args), model(*args, dense_mix=mix)
        monkeypatch.setattr(attention_levers, "read_weights", _no_device_read)
        with weights_on_host(host_weights(_cfg(arch, **levers), args[1])):
            assert torch.equal(model(*args), want_t)
        with weights_on_host(mix):
            assert torch.equal(model(*args, dense_mix=mix), want_mix)
        with weights_on_host(torch.zeros(3)):  # every sample the block's kind: sample 0 is not dense now
            wrong = model(*args)
        assert torch.equal(wrong[1], want_t[1]) and not torch.equal(wrong[0], want_t[0])
        with weights_on_host(torch.zeros(2)), pytest.raises(ValueError, match="2 dense weights for a batch of 3"):
            model(*args)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_whole_model_reads_the_device_once_per_forward(arch, monkeypatch):
    """Called directly (sampling, validation) with the levers on, the whole model reads ``c``'s
    dense weights back once per forward (a device sync on CUDA), not once per block, and gives
    what its shards called one by one give (each block reading the column itself)."""
    model, _, _ = _models(arch, **{"attention.dense_above_t": 0.6, "attention.dense_warmup_steps": 4})
    args = _inputs(arch, [0.9, 0.2, 0.6])
    reads, read = [], attention_levers.read_weights
    monkeypatch.setattr(attention_levers, "read_weights", lambda mix: reads.append(mix.shape) or read(mix))
    for kw in ({}, {"dense_mix": torch.tensor([1.0, 0.3, 0.0])}):  # by t; a dense, a blended, a dsa sample
        with torch.no_grad():
            shards = model.shards()
            x, c = shards[0](*args, **kw)
            for block in shards[1:-1]:
                x = block(x, c)
            want = shards[-1](x, c)
            assert len(reads) == len(model.blocks) == 2  # a block called alone reads the column itself
            reads.clear()
            assert torch.equal(model(*args, **kw), want)
        assert reads == [torch.Size([3])]
        reads.clear()


def test_host_weights_are_rounded_as_the_column_is():
    """A bf16 ``c`` rounds a weight of 0.999 to 1: the host's choice rounds alike (dense alone)."""
    calls = []

    def run(kind, rows):
        calls.append((kind, rows))
        return torch.ones(2 if rows is None else len(rows), 3)

    with weights_on_host(torch.tensor([0.999, 0.0])):
        attention_levers.blend(torch.tensor([0.999, 0.0]).to(torch.bfloat16), run)
    assert calls == [("dense", [0]), (None, [1])]
    calls.clear()
    with weights_on_host(torch.tensor([0.999, 0.0])):
        attention_levers.blend(torch.tensor([0.999, 0.0]), run)  # fp32: a blend of both kinds
    assert calls == [("dense", [0]), (None, [0, 1])]


# -- the streamed trainer against the in-process trainer -----------------------------------------

SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
         "training.steps": 3, "optim.grad_clip": 0.05, "optim.weight_decay": 0.05, "optim.lr": 3e-3}


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return demo_batches(tmp_path_factory, SMALL, 3)


@pytest.mark.parametrize("lever", [{"attention.dense_blocks": "1"}, {"attention.dense_above_t": 0.5},
                                   {"attention.dense_warmup_steps": 4},
                                   {"attention.dense_warmup_steps": 4, "runtime.recompute_blocks": "false"},
                                   {"attention.dense_blocks": "1", "attention.dense_warmup_steps": 4,
                                    "attention.learn_temperature": "true", "training.ema_decay": 0.5}],
                         ids=["dense_blocks", "dense_above_t", "curriculum", "curriculum-kept-graphs",
                              "with-temperature-and-average"])
def test_streamed_trainer_equals_in_process_with_each_lever(tmp_path, batches, lever, monkeypatch):
    manifest, bs = batches
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      **lever})
    baseline = InProcessTrainer(cfg, threads=1)
    b = bs[0]
    args = (torch.randn((2, 6, 32, 32, 3), generator=torch.Generator().manual_seed(5)), torch.tensor([0.9, 0.2]),
            torch.from_numpy(b["caption"][:2]), torch.from_numpy(b["caption_len"][:2]))
    monkeypatch.setattr(attention_levers, "read_weights", _no_device_read)  # both trainers choose on the host
    with streamed(cfg, tmp_path / "run") as (store, compute):
        results = train_steps(store, compute, bs)
        weights = masters(store)
        predicted = compute.predict(*args, step=len(bs))  # sampling and validation: the schedule's end
    reference = [baseline.train_step(batch) for batch in bs]
    monkeypatch.undo()
    _check_prediction(cfg, baseline.model, predicted, args)
    assert_streamed_equals_in_process(results, weights, reference, baseline.model)
    if "attention.dense_above_t" in lever:  # the draws put samples on both sides of the time
        ts = [t for r in results for t in r.t]
        assert min(ts) < 0.5 <= max(ts), ts


def _check_prediction(cfg, model, predicted, args) -> None:
    """The compute actor's prediction after training (the store's weights, within 1e-5 of the
    in-process model's) is the in-process model's: with ``dense_above_t`` 0.5 the sample at t = 0.9
    the dense model's and the one at 0.2 DSA's; after the curriculum both DSA's."""
    tau = {"attention.learn_temperature": str(cfg.attention.learn_temperature).lower()}
    kinds = {"dense": build_config("tiny", None, {**SMALL, **tau, "attention.kind": "dense"}),
             "dsa": build_config("tiny", None, {**SMALL, **tau, "attention.dense_blocks": cfg.attention.dense_blocks})}
    out = {}
    with torch.no_grad():
        for name, c in kinds.items():
            other = build_model(c)
            other.load_state_dict(model.state_dict(), strict=False)
            out[name] = other(*args)
        want = model(*args)
    assert float((predicted - want).norm() / want.norm()) < 1e-5
    first = "dense" if cfg.attention.dense_above_t else "dsa"
    assert torch.equal(want[0], out[first][0]) and torch.equal(want[1], out["dsa"][1])
    assert float((out["dense"][0] - out["dsa"][0]).norm() / out["dsa"][0].norm()) > 1e-4  # so the equalities tell


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("over,needle", [
    ({"attention.dense_blocks": "0,2"}, "attention.dense_blocks=[0, 2]: block 2 is not one of the model's blocks 0 .. 1"),
    ({"attention.dense_blocks": "-1"}, "block -1 is not one"),
    ({"attention.dense_blocks": "1,1"}, "names a block twice"),
    ({"attention.dense_above_t": 1.5}, "attention.dense_above_t=1.5 must be a flow time in [0, 1)"),
    ({"attention.dense_above_t": -0.1}, "attention.dense_above_t=-0.1"),
    ({"attention.dense_above_t": 1.0}, "no sample reaches"),
    ({"attention.dense_warmup_steps": -3}, "attention.dense_warmup_steps=-3 must be >= 0"),
    ({"attention.kind": "dense", "attention.dense_blocks": "0"}, "attention.dense_blocks=[0] with attention.kind='dense'"),
    ({"attention.kind": "dense", "attention.dense_above_t": 0.9}, "attention.dense_above_t=0.9 with attention.kind='dense'"),
    ({"attention.kind": "dense", "attention.dense_warmup_steps": 10}, "dense_warmup_steps=10 with attention.kind='dense'"),
])
def test_levers_that_make_no_sense_are_refused(over, needle):
    with pytest.raises(ConfigError) as e:
        _cfg("videodit", **over)
    assert needle in str(e.value)


def test_dense_samples_the_low_noise_expert_never_sees_are_refused():
    with pytest.raises(ConfigError, match=r"attention.dense_above_t=0.9 with training.expert='low'"):
        build_config("wan2.2-t2v-a14b", None, {"attention.dense_above_t": 0.9, "training.expert": "low"})
    build_config("wan2.2-t2v-a14b", None, {"attention.dense_above_t": 0.5, "training.expert": "low"})


def test_a_pretrained_dense_model_loads_into_dense_blocks(wan_dir, tmp_path):
    """``--init-from`` a diffusers Wan folder (dense, no offset heads) with block 0 dense: only
    block 1's offset head starts fresh, and the store's shards are filled."""
    from megaslide_ray.state.pretrained_io import (
        check_pretrained,
        config_for_diffusers_dir,
        describe_init,
        load_pretrained_into,
    )

    cfg = config_for_diffusers_dir(wan_dir, None, None, {"attention.dense_blocks": "0",
                                                        "runtime.state_dir": str(tmp_path)})
    assert cfg.attention.kind == "dsa" and cfg.model.depth == 2
    line = describe_init(cfg, str(wan_dir), check_pretrained(cfg, str(wan_dir)))
    assert "start fresh: the DSA offset heads (blocks.1.attn1.offsets.*)" in line, line
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        load_pretrained_into(store, wan_dir)
        assert all(torch.isfinite(s["master"]).all() for s in store.seg)
    finally:
        store.close()


def test_the_planner_counts_dense_blocks_and_dense_samples():
    """The planner's attention FLOPs: every block dense is the dense model's; dense samples weigh
    the dense and the lever-free counts by the trainer's share of t above the time (within an
    expert's range); its notes name the levers."""
    from megaslide_ray.planning.estimate import plan
    from megaslide_ray.planning.terms import _attention_flops_fwd, dense_share
    from megaslide_ray.training.flow import base_cdf

    dense, dsa = _attention_flops_fwd(_cfg("videodit", **{"attention.kind": "dense"})), _attention_flops_fwd(_cfg("videodit"))
    assert _attention_flops_fwd(_cfg("videodit", **{"attention.dense_blocks": "0,1"})) == dense
    one = _attention_flops_fwd(_cfg("videodit", **{"attention.dense_blocks": "1"}))
    assert math.isclose(one, (dense + dsa) / 2)
    cfg = _cfg("videodit", **{"attention.dense_above_t": 0.7, "training.flow_shift": 3.0})
    p = 1.0 - base_cdf(0.7, "logit_normal", 3.0)
    assert math.isclose(dense_share(cfg), p)
    assert math.isclose(_attention_flops_fwd(cfg), p * dense + (1 - p) * dsa)
    high = build_config("wan2.2-t2v-a14b", None, {"attention.dense_above_t": 0.9, "training.expert": "high"})
    b = high.training.boundary_ratio
    want = (1 - base_cdf(0.9, "logit_normal", 5.0)) / (1 - base_cdf(b, "logit_normal", 5.0))
    assert math.isclose(dense_share(high), want)
    low = build_config("wan2.2-t2v-a14b", None, {"attention.dense_above_t": 0.5, "training.expert": "low"})
    want = (base_cdf(b, "logit_normal", 5.0) - base_cdf(0.5, "logit_normal", 5.0)) / base_cdf(b, "logit_normal", 5.0)
    assert math.isclose(dense_share(low), want)
    notes = plan(_cfg("videodit", **{"attention.dense_blocks": "1", "attention.dense_warmup_steps": 5})).notes
    assert any("1 dense blocks" in n and "first 5 steps" in n for n in notes), notes


def test_the_planner_counts_the_dense_blocks_parameters():
    """Dense blocks have no offset heads: the planner's per-shard counts are the built shards'."""
    from megaslide_ray.models.registry import build_shard
    from megaslide_ray.planning.terms import _shard_counts

    cfg = _cfg("videodit", **{"model.depth": 3, "attention.dense_blocks": "0,2"})
    counts, *_, offsets = _shard_counts(cfg)
    built = [sum(p.numel() for p in build_shard(cfg, i, "meta").parameters()) for i in range(5)]
    assert counts == built and counts[1] < counts[2] and counts[1] == counts[3]
    assert offsets == sum(p.numel() for n, p in build_shard(cfg, 2, "meta").named_parameters() if ".offsets." in n)
