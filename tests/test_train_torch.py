"""The training tool's torch model is a second implementation of the K3 forward pass.

Before it trains anything it must agree with the float64 numpy oracle and the C engine on
the same random weights (the adversarial tiny fixture, spec 9.2), its chunked KDA must agree
with the naive recurrence, its MXFP4 fake quantization must be the codec's, and what it
exports must be what it computed. torch is an optional extra (`pip install '.[train]'`):
without it these tests are skipped, with that reason in the summary.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[train]' runs these tests")

from k3engine import mxfp4  # noqa: E402
from k3engine.fixture import PRESETS  # noqa: E402
from k3engine.model import Model  # noqa: E402
from k3engine.oracle import Oracle  # noqa: E402
from k3engine.train import kda  # noqa: E402
from k3engine.train.model import K3Torch, mxfp4_values  # noqa: E402

TOL = 5e-5  # spec 9.3 G6: max |l - l_oracle| <= 5e-5 max(1, max |l_oracle|) per position


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]


def _loaded(model_dir: Path, dtype: object) -> K3Torch:
    m = K3Torch(PRESETS["tiny"], _vocab(model_dir), dtype=dtype)
    m.quantize = False
    m.load_checkpoint(model_dir)
    return m


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    scale = np.maximum(1.0, np.abs(ref).max(axis=-1))
    return float((np.abs(a - ref).max(axis=-1) / scale).max())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_logits_match_the_oracle_and_the_engine_on_random_weights(tiny_dir: Path,
                                                                        tiny_oracle: dict, dtype: str) -> None:
    ids = [int(i) for i in tiny_oracle["full_ids"]]
    m = _loaded(tiny_dir, getattr(torch, dtype))
    with torch.no_grad():
        ours = m(torch.tensor([ids]))[0].double().numpy()
    oracle = Oracle(tiny_dir).forward(ids)
    engine = Model(tiny_dir).forward(ids)
    assert _rel_err(ours, oracle) <= TOL
    assert _rel_err(ours, engine) <= TOL
    assert np.array_equal(ours.argmax(-1), oracle.argmax(-1))
    # and it can fail: one AttnRes weight off by a little moves the logits past the tolerance
    name = "language_model.model.layers.4.mlp_res_norm.weight"
    with torch.no_grad():
        m.w(name).mul_(1.05)
        moved = m(torch.tensor([ids]))[0].double().numpy()
    assert _rel_err(moved, oracle) > TOL


def _kda_inputs(seed: int, b: int, h: int, t: int, d: int, strong: bool) -> tuple:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q = torch.nn.functional.normalize(torch.randn(b, h, t, d, dtype=f64, generator=g), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, d, dtype=f64, generator=g), dim=-1)
    v = torch.randn(b, h, t, d, dtype=f64, generator=g)
    low = -5.0 if strong else -0.5
    gate = low * torch.rand(b, h, t, d, dtype=f64, generator=g)   # log decay in (g_min, 0)
    beta = torch.rand(b, h, t, dtype=f64, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("chunk", [1, 4, 8, 16])
@pytest.mark.parametrize("strong", [False, True])
def test_chunked_kda_equals_the_naive_recurrence(chunk: int, strong: bool) -> None:
    q, k, v, g, beta = _kda_inputs(chunk, 2, 3, 37, 16, strong)
    o_ref, s_ref = kda.naive(q, k, v, g, beta)
    o, s = kda.chunked(q, k, v, g, beta, chunk=chunk)
    assert torch.allclose(o, o_ref, atol=1e-10, rtol=1e-10)
    assert torch.allclose(s, s_ref, atol=1e-10, rtol=1e-10)
    # a carried state: two halves equal one pass
    o1, s1 = kda.chunked(q[:, :, :20], k[:, :, :20], v[:, :, :20], g[:, :, :20], beta[:, :, :20], chunk=chunk)
    o2, s2 = kda.chunked(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], g[:, :, 20:], beta[:, :, 20:], chunk=chunk,
                         state=s1)
    assert torch.allclose(torch.cat([o1, o2], dim=2), o_ref, atol=1e-10)
    assert torch.allclose(s2, s_ref, atol=1e-10)


@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_kda_in_float32_at_the_strongest_decay_stays_finite_and_close(chunk: int) -> None:
    """Training runs in float32: at g next to g_min = -5 for a whole chunk the split factors
    reach exp(5 C) (exp(80) at C = 16); the output and every gradient must stay finite and
    match the float64 recurrence."""
    q, k, v, _, beta = _kda_inputs(11, 2, 3, 45, 16, True)
    g = torch.full_like(q, -4.999)
    o_ref, s_ref = kda.naive(q, k, v, g, beta)
    leaves = [x.float().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, s = kda.chunked(*leaves, chunk=chunk)
    assert torch.allclose(o.double(), o_ref, atol=2e-5) and torch.allclose(s.double(), s_ref, atol=2e-5)
    (o.square().sum() + s.square().sum()).backward()
    ref = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o64, s64 = kda.naive(*ref)
    (o64.square().sum() + s64.square().sum()).backward()
    for got, want in zip(leaves, ref):
        assert torch.isfinite(got.grad).all()
        assert torch.allclose(got.grad.double(), want.grad, atol=2e-4, rtol=1e-3)


def test_chunked_kda_reads_the_updated_state_and_decays_first() -> None:
    """The naive reference itself: against a hand-written recurrence (spec 5.4 step 6)."""
    q, k, v, g, beta = _kda_inputs(5, 1, 1, 6, 4, True)
    s = np.zeros((4, 4))
    outs = []
    for t in range(6):
        s = np.exp(g[0, 0, t].numpy())[:, None] * s
        u = s.T @ k[0, 0, t].numpy()
        s = s + np.outer(k[0, 0, t].numpy(), beta[0, 0, t].item() * (v[0, 0, t].numpy() - u))
        outs.append(s.T @ q[0, 0, t].numpy())
    o, _ = kda.chunked(q, k, v, g, beta, chunk=4)
    assert np.allclose(o[0, 0].numpy(), np.array(outs), atol=1e-12)


def test_mxfp4_fake_quantization_is_the_codec() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)) * np.exp(rng.uniform(-6, 3, size=(48, 1)))
    w[0, :32] = 0.0                                   # an all-zero group
    w[1, :32] = np.linspace(-6, 6, 32) * 2.0 ** -3    # values on code midpoints after scaling
    w[2, 5] = 0.75 * 2.0 ** -2                        # a tie between 0.5 and 1.0 steps
    w = w.astype(np.float32).astype(np.float64)
    packed, scales = mxfp4.quantize(w)
    want, _ = mxfp4.decode(packed, scales)
    got = mxfp4_values(torch.tensor(w)).numpy()
    assert np.array_equal(got, want)


def test_exported_checkpoint_is_what_the_torch_model_computed(tmp_path: Path) -> None:
    """Quantization-aware forward (BF16 trunk, MXFP4 experts) == the C engine on the export."""
    from k3chat.demo.train import DEMO_PRESET, export
    from k3engine.tokenizer_files import write_fixture_tokenizer

    vocab = write_fixture_tokenizer(tmp_path)
    m = K3Torch(DEMO_PRESET, vocab, seed=3)
    with torch.no_grad():                              # larger than the init, so routing matters
        for name, p in m.named_weights():
            if p.ndim >= 2:
                p.mul_(4.0)
    export(m, tmp_path, seed=3)
    ids = list(range(5, 45))
    with torch.no_grad():
        ours = m(torch.tensor([ids]))[0].double().numpy()
    engine = Model(tmp_path).forward(ids)
    assert _rel_err(engine, ours) <= TOL
    reloaded = K3Torch(DEMO_PRESET, vocab)
    reloaded.quantize = False
    reloaded.load_checkpoint(tmp_path)
    with torch.no_grad():
        again = reloaded(torch.tensor([ids]))[0].double().numpy()
    assert np.array_equal(again, ours)                 # the stored values are exactly the trained ones


def _compile_or_skip() -> None:
    from k3chat.demo.train import compile_unavailable

    broken = compile_unavailable()
    if broken:
        pytest.skip(f"torch.compile does not work here ({broken}): the --compile tests need a C++ compiler")


def test_compiled_pieces_match_the_oracle_on_random_weights(tiny_dir: Path, tiny_oracle: dict) -> None:
    """--compile trains through Kernels(compiled=True): the same forward pass up to rounding,
    so it too agrees with the float64 oracle within spec 9.3's tolerance, MLA's fused
    attention with its padded values included."""
    _compile_or_skip()
    ids = [int(i) for i in tiny_oracle["full_ids"]]
    m = K3Torch(PRESETS["tiny"], _vocab(tiny_dir), compiled=True)
    m.quantize = False
    m.load_checkpoint(tiny_dir)
    assert PRESETS["tiny"].v_head_dim < PRESETS["tiny"].qk_nope_head_dim + PRESETS["tiny"].qk_rope_head_dim
    with torch.no_grad():
        ours = m(torch.tensor([ids, ids[::-1]]))[0].double().numpy()     # two rows: batched as in training
    assert _rel_err(ours, Oracle(tiny_dir).forward(ids)) <= TOL


def test_compiled_pieces_give_the_eager_logits_and_gradients_on_the_demo_shape() -> None:
    """On the demo's own shape, quantization-aware as it trains, with padding and scored rows:
    the compiled model's logits and every gradient are the eager model's up to float32
    rounding (they differ: fusion rounds otherwise, which is why a compiled run is another
    model), and one piece wrong would show: attention without its padding cut off does."""
    _compile_or_skip()
    from k3chat.demo.train import DEMO_PRESET
    from k3engine.train.model import Kernels

    vocab = 300
    eager, compiled = K3Torch(DEMO_PRESET, vocab, seed=7), K3Torch(DEMO_PRESET, vocab, seed=7, compiled=True)
    with torch.no_grad():
        for (_, a), (_, b) in zip(eager.named_weights(), compiled.named_weights()):
            if a.ndim >= 2:
                a.mul_(4.0)                                  # larger than the init, so routing matters
                b.copy_(a)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, vocab, (3, 37), generator=g)
    target = torch.randint(0, vocab, (3, 37), generator=g)
    rows = torch.rand(3, 37, generator=g) < 0.6
    results = []
    for model in (eager, compiled):
        logits = model(ids, [], rows=rows)
        model.zero_grad()
        torch.nn.functional.cross_entropy(logits, target[rows]).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_weights() if p.grad is not None}))
    (le, ge), (lc, gc) = results
    assert (lc - le).abs().max() <= 1e-4 * le.abs().max()
    assert set(ge) == set(gc) and len(ge) > 100
    for name in ge:
        assert (gc[name] - ge[name]).abs().max() <= 1e-3 * ge[name].abs().max() + 1e-12, name

    class Uncut(Kernels):            # the padded value columns left in: the output is wrong
        def attention(self, q, key, value, mask, scale):  # type: ignore[no-untyped-def]
            full = torch.nn.functional.pad(value, (0, key.shape[-1] - value.shape[-1]))
            out = torch.nn.functional.scaled_dot_product_attention(q, key, full, is_causal=True, scale=scale)
            return out[..., -value.shape[-1]:]
    compiled.k = Uncut(compiled=True)
    with torch.no_grad():
        assert (compiled(ids, rows=rows) - le).abs().max() > 1e-2 * le.abs().max()


def test_logits_of_selected_rows_are_those_rows_of_the_full_logits(tiny_dir: Path) -> None:
    """The trainer asks for the scored positions only; they must be the same logits."""
    m = _loaded(tiny_dir, torch.float64)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, _vocab(tiny_dir), (3, 21), generator=g)
    rows = torch.rand(3, 21, generator=g) < 0.5
    with torch.no_grad():
        full = m(ids)
        some = m(ids, rows=rows)
    assert some.shape == (int(rows.sum()), full.shape[-1])
    assert torch.allclose(some, full[rows], rtol=0, atol=1e-12)
    assert not torch.allclose(some, full[rows.roll(1, dims=1)], rtol=0, atol=1e-3)   # other rows differ


def test_tied_embeddings_train_one_matrix_and_export_k3s_two_tensors(tmp_path: Path) -> None:
    """train-demo's default: the lm_head is the embedding's parameter while training; the
    checkpoint still holds both K3 tensors (equal), and the C engine computes what torch did."""
    from k3chat.demo.train import DEMO_PRESET, export
    from k3engine.oracle import Checkpoint
    from k3engine.tokenizer_files import write_fixture_tokenizer

    vocab = write_fixture_tokenizer(tmp_path)
    m = K3Torch(DEMO_PRESET, vocab, seed=4, tie_embeddings=True)
    embed, head = m.w("language_model.model.embed_tokens.weight"), m.w("language_model.lm_head.weight")
    assert embed is head
    untied = K3Torch(DEMO_PRESET, vocab, seed=4)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in m.parameters()) == embed.numel()
    with torch.no_grad():                              # a step's change reaches both uses
        embed.add_(torch.randn(embed.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    export(m, tmp_path, seed=4)
    ck = Checkpoint(tmp_path)
    stored_embed = np.asarray(ck.tensor("language_model.model.embed_tokens.weight"))
    stored_head = np.asarray(ck.tensor("language_model.lm_head.weight"))
    assert np.array_equal(stored_embed, stored_head)
    ids = list(range(5, 30))
    with torch.no_grad():
        ours = m(torch.tensor([ids]))[0].double().numpy()
    assert _rel_err(Model(tmp_path).forward(ids), ours) <= TOL


def test_copy_warmup_rows_repeat_a_run_and_train_only_on_the_repeat() -> None:
    import random

    from k3chat.demo.train import copy_warmup_batch

    pool, bos, sep, pad = list(range(10, 60)), 1, 2, 0
    ids, target = copy_warmup_batch(torch, random.Random(3), pool, bos, sep, pad, n_seqs=64)
    lengths = set()
    for row, tgt in zip(ids.tolist(), target.tolist()):
        assert row[0] == bos and row.count(sep) == 1
        s = row.index(sep)
        run = row[1:s]
        end = s + 1 + len(run)
        assert row[s + 1:end] == run and all(x == pad for x in row[end:]), row
        assert set(run) <= set(pool)
        lengths.add(len(run))
        for j, t in enumerate(tgt):                # position j predicts id j + 1, only the copy
            assert t == (row[j + 1] if s <= j < end - 1 else -100), (j, row, tgt)
    assert min(lengths) == 3 and max(lengths) == 12      # lengths vary: no fixed offset to learn


def test_copy_mix_rows_add_their_own_loss_and_leave_the_task_loss_as_it_was(tmp_path: Path) -> None:
    """One step from the same weights on the same batch: the logged task loss is the same
    with and without --copy-mix (its rows are a separate forward with their own rng), and
    the copy loss is kept apart, near ln(vocab) for an untrained model."""
    import json
    import math

    from k3chat.demo.train import train

    runs = {}
    for mix in (0, 4):
        out = tmp_path / f"mix{mix}"
        runs[mix] = train(out, steps=1, seed=5, conversations=30, batch_tokens=256, lr=1e-3, threads=1,
                          resume=False, copy_mix=mix)
        assert json.loads((out / "training.json").read_text())["copy_mix"] == mix
    assert runs[0]["final_loss"] == runs[4]["final_loss"]
    assert runs[0]["copy_loss_every_50"] == []
    (copy_loss,) = runs[4]["copy_loss_every_50"]
    vocab = json.loads((tmp_path / "mix4" / "config.json").read_text())["text_config"]["vocab_size"]
    assert abs(copy_loss - math.log(vocab)) < 1.0, (copy_loss, vocab)


def test_copy_mix_from_leaves_the_steps_before_it_as_the_plain_runs(tmp_path: Path) -> None:
    """--copy-mix-from 2 on a 3-step run: the copy rows join at the last step only, so the
    task losses (each taken before its step's update) are the plain run's exactly, while the
    weights written at the end are not (that last update had the copy rows' gradient)."""
    import json

    from k3chat.demo.train import train

    meta, weights = {}, {}
    for mix, start in ((0, 0), (4, 2)):
        out = tmp_path / f"mix{mix}"
        meta[mix] = train(out, steps=3, seed=5, conversations=30, batch_tokens=256, lr=1e-3, threads=1,
                          resume=False, copy_mix=mix, copy_mix_from=start)
        weights[mix] = {p.name: p.read_bytes() for p in sorted(out.glob("model-*.safetensors"))}
    assert meta[4]["copy_steps"] == 1 and meta[0]["copy_steps"] == 0
    assert meta[4]["copy_mix_from"] == 2
    assert meta[4]["loss_every_50"] == meta[0]["loss_every_50"]
    assert weights[4].keys() == weights[0].keys() and weights[4] != weights[0]


def test_copy_mix_until_leaves_the_steps_after_it_to_the_tasks(tmp_path: Path) -> None:
    """--copy-mix-until 1 on a 3-step run: only the first step adds copy rows. Its update has
    their gradient, so from the second step on the task losses differ from the plain run's,
    while the first (taken before any update) is the same."""
    import json

    from k3chat.demo.train import train

    meta = {}
    for mix, until in ((0, 0), (4, 1)):
        meta[mix] = train(tmp_path / f"mix{mix}", steps=3, seed=5, conversations=30, batch_tokens=256,
                          lr=1e-3, threads=1, resume=False, copy_mix=mix, copy_mix_until=until)
    assert meta[4]["copy_steps"] == 1 and meta[4]["copy_mix_until"] == 1
    assert len(meta[4]["copy_loss_every_50"]) == 1
    written = json.loads((tmp_path / "mix4" / "training.json").read_text())
    assert written["copy_steps"] == 1
    assert meta[4]["loss_every_50"] != meta[0]["loss_every_50"]


def test_recall_rows_give_a_file_and_train_only_on_the_figures_of_the_lines_asked() -> None:
    import random

    from k3chat.demo.train import recall_batch

    class Tok:                                  # one id per byte: every id decodes to itself
        class encoding:
            @staticmethod
            def encode_ordinary(text: str) -> list[int]:
                return list(text.encode())

    bos, sep, pad = 300, 301, 302
    ids, target, lookup = recall_batch(torch, random.Random(4), Tok, bos, sep, pad, n_seqs=40)
    for row, tgt, look in zip(ids.tolist(), target.tolist(), lookup.tolist()):
        assert row[0] == bos and row.count(sep) == 1
        s = row.index(sep)
        end = row.index(pad) if pad in row else len(row)
        file, asked = bytes(row[1:s]).decode(), bytes(row[s + 1:end]).decode()
        lines = asked.splitlines()
        assert asked.endswith("\n") and set(lines) <= set(file.splitlines()), (file, asked)
        # position j predicts id j + 1: trained exactly on what follows each line's label
        assert tgt[-1] == -100
        trained = "".join(chr(row[j + 1]) for j, t in enumerate(tgt[:-1]) if t != -100)
        assert all(t in (-100, row[j + 1]) for j, t in enumerate(tgt[:-1]))
        want = "".join(line[line.rfind(",") if "," in line else line.index(":"):] + "\n" for line in lines)
        assert trained == want, (asked, trained)
        assert all(t == -100 for t in tgt[:s])                      # never on the file itself
        # the lookups: exactly the positions predicting each asked line's first digit
        firsts = [j for j in range(s, end - 1) if chr(row[j + 1]).isdigit() and not chr(row[j]).isdigit()]
        assert [j for j, x in enumerate(look) if x] == firsts and len(firsts) == len(lines)


def test_recall_mix_adds_its_own_loss_and_stops_at_its_step(tmp_path: Path) -> None:
    """--recall-mix 4 --recall-mix-until 1 on a 2-step run: only the first step has the rows,
    their loss is kept apart from the task loss (near ln(vocab) untrained), and their
    gradient changes what the second step sees."""
    import json
    import math

    from k3chat.demo.train import train

    meta = {}
    for mix, until in ((0, 0), (4, 1)):
        meta[mix] = train(tmp_path / f"r{mix}", steps=2, seed=5, conversations=30, batch_tokens=256,
                          lr=1e-3, threads=1, resume=False, recall_mix=mix, recall_mix_until=until)
    written = json.loads((tmp_path / "r4" / "training.json").read_text())
    assert written["recall_mix"] == 4 and written["recall_mix_until"] == 1 and written["recall_steps"] == 1
    assert meta[0]["recall_steps"] == 0 and meta[0]["recall_loss_every_50"] == []
    vocab = json.loads((tmp_path / "r4" / "config.json").read_text())["text_config"]["vocab_size"]
    (recall_loss,) = meta[4]["recall_loss_every_50"]
    assert abs(recall_loss - math.log(vocab)) < 1.0, (recall_loss, vocab)
    assert meta[4]["loss_every_50"] != meta[0]["loss_every_50"]       # the update had its gradient


def test_ffn_lr_puts_exactly_the_feed_forward_weights_apart_and_1_keeps_the_old_groups() -> None:
    """At 1 the groups are the two every earlier run had (matrices decaying, the rest not, the
    router's bias frozen), in the same order; at 0.25 the dense MLP's, routers' and experts'
    weights, and only they, sit in groups at a quarter of the rate, each weight once."""
    from k3chat.demo.train import DEMO_PRESET, param_groups
    from k3engine.train.model import K3Torch

    model = K3Torch(DEMO_PRESET, 300, seed=0)
    named = [(n, p) for n, p in model.named_weights() if not n.endswith("e_score_correction_bias")]
    decay = [p for n, p in named if p.ndim >= 2 and "conv1d" not in n]
    plain = [p for n, p in named if not (p.ndim >= 2 and "conv1d" not in n)]
    old = param_groups(model, 1.0)
    assert [[id(p) for p in g["params"]] for g in old] == [[id(p) for p in decay], [id(p) for p in plain]]
    assert [(g["weight_decay"], g["lr_scale"]) for g in old] == [(0.01, 1.0), (0.0, 1.0)]
    scaled = {id(p): g["lr_scale"] for g in param_groups(model, 0.25) for p in g["params"]}
    assert len(scaled) == len(named) == sum(len(g["params"]) for g in param_groups(model, 0.25))
    ffn = {n for n, _ in named if ".mlp." in n or ".block_sparse_moe." in n}
    assert any(".experts.w1" in n for n in ffn) and any("layers.0.mlp.gate_proj" in n for n in ffn)
    assert all(scaled[id(p)] == (0.25 if n in ffn else 1.0) for n, p in named)
    assert not any("attn" in n for n in ffn)


def test_ffn_lr_is_applied_in_the_training_loop(tmp_path: Path) -> None:
    """A 1-step run at --ffn-lr 1e-6 writes layer 0's dense MLP weights as the untrained model
    has them while its attention weights move; at 1 both move (Adam's first step moves each
    weight by about the rate, 3e-3 here, well past BF16's rounding of these weights)."""
    import json

    from safetensors import safe_open

    from k3chat.demo.train import DEMO_PRESET, train

    ffn_w, attn_w = "language_model.model.layers.0.mlp.up_proj.weight", "language_model.model.layers.0.self_attn.q_proj.weight"
    share_moved = {}
    for ffn in (1.0, 1e-6):
        out = tmp_path / f"f{ffn}"
        meta = train(out, steps=1, seed=3, conversations=20, batch_tokens=256, lr=3e-3, threads=1,
                     resume=False, ffn_lr=ffn)
        assert json.loads((out / "training.json").read_text())["ffn_lr"] == ffn == meta["ffn_lr"]
        vocab = json.loads((out / "config.json").read_text())["text_config"]["vocab_size"]
        untrained = dict(K3Torch(DEMO_PRESET, vocab, seed=3).named_weights())
        written = {}
        for shard in out.glob("model-*.safetensors"):
            with safe_open(str(shard), framework="pt") as f:
                written.update({k: f.get_tensor(k) for k in f.keys() if k in (ffn_w, attn_w)})
        share_moved[ffn] = {k: float((written[k] != untrained[k].detach().to(written[k].dtype)).float().mean())
                            for k in (ffn_w, attn_w)}
    assert share_moved[1.0][ffn_w] > 0.5 and share_moved[1.0][attn_w] > 0.5, share_moved
    assert share_moved[1e-6][ffn_w] < 0.01 and share_moved[1e-6][attn_w] > 0.5, share_moved


def test_count_weight_weighs_only_the_decisions_and_logs_the_plain_loss(tmp_path: Path) -> None:
    """decision_weights puts W where collate puts the target of a decision id (one position
    before it) and 1 elsewhere; a one-step run logs the same (unweighted) loss with and
    without --count-weight, while its update, and so the weights written, differ."""
    import json

    from k3chat.demo.train import collate, decision_weights, train

    seqs = [([5, 6, 7, 8, 9], [False, True, True, True, True]), ([5, 6, 7], [False, True, True])]
    w = decision_weights(torch, seqs, [1, 0], [[3], [2]], 4.0)
    _, target = collate(torch, seqs, [1, 0], 0)
    assert w.shape == target.shape
    assert w[0].tolist() == [1.0, 4.0, 1.0, 1.0, 1.0] and target[0, 1] == 7      # seq 1's id 2
    assert w[1].tolist() == [1.0, 1.0, 4.0, 1.0, 1.0] and target[1, 2] == 8      # seq 0's id 3

    meta, weights = {}, {}
    for cw in (1.0, 20.0):
        out = tmp_path / f"cw{cw:g}"
        meta[cw] = train(out, steps=1, seed=5, conversations=120, batch_tokens=8192, lr=1e-3, threads=1,
                         resume=False, count_weight=cw)
        assert json.loads((out / "training.json").read_text())["count_weight"] == cw
        weights[cw] = {p.name: p.read_bytes() for p in sorted(out.glob("model-*.safetensors"))}
    assert abs(meta[1.0]["final_loss"] - meta[20.0]["final_loss"]) < 1e-5
    assert weights[1.0].keys() == weights[20.0].keys() and weights[1.0] != weights[20.0]


def _interrupt_after_state_saves(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Save train_state.pt after every step and stop the run (as Ctrl-C would) right after the
    n-th save has been written and closed."""
    import contextlib

    from k3chat.demo import train as train_mod

    real_open, saves = train_mod.open_private, []

    @contextlib.contextmanager
    def open_then_stop(path: Path):  # type: ignore[no-untyped-def]
        with real_open(path) as fh:
            yield fh
        saves.append(path)
        if len(saves) == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "STATE_EVERY", 1)
    monkeypatch.setattr(train_mod, "open_private", open_then_stop)


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after step 2 of 3 and resumed with the same options, a run writes the weights
    an uninterrupted run writes, bit for bit, and training.json says where it resumed."""
    import json

    from k3chat.demo.train import train

    opts = dict(steps=3, seed=5, conversations=30, batch_tokens=256, lr=1e-3, threads=1)
    train(tmp_path / "whole", resume=False, **opts)
    with monkeypatch.context() as m:
        _interrupt_after_state_saves(m, 2)
        with pytest.raises(KeyboardInterrupt):
            train(tmp_path / "cut", resume=False, **opts)
    assert (tmp_path / "cut" / "train_state.pt").exists()
    assert not list((tmp_path / "cut").glob("model-*.safetensors"))
    meta = train(tmp_path / "cut", resume=True, **opts)
    assert meta["resumed_at"] == 2
    assert json.loads((tmp_path / "cut" / "training.json").read_text())["resumed_at"] == 2
    whole = json.loads((tmp_path / "whole" / "training.json").read_text())
    assert whole["resumed_at"] is None and whole["loss_every_50"] == meta["loss_every_50"]
    shards = sorted(p.name for p in (tmp_path / "whole").glob("model-*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "cut").glob("model-*.safetensors"))
    for name in shards:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name
    assert not (tmp_path / "cut" / "train_state.pt").exists()


def test_resume_refuses_another_recipe_a_missing_state_and_a_damaged_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--resume continues only the run that was interrupted: other options (here --steps and
    the training text's --sign-by-places) are named and refused, exit 2, before any data is
    made; so are a directory without a state and a state that is not one."""
    from k3chat.demo.train import main, train

    out = tmp_path / "cut"
    with monkeypatch.context() as m:
        _interrupt_after_state_saves(m, 1)
        with pytest.raises(KeyboardInterrupt):
            train(out, steps=3, seed=5, conversations=30, batch_tokens=256, lr=1e-3, threads=1, resume=False)
    state = (out / "train_state.pt").read_bytes()
    base = ["--out", str(out), "--seed", "5", "--conversations", "30", "--batch-tokens", "256",
            "--lr", "1e-3", "--threads", "1", "--resume"]

    assert main([*base, "--steps", "4", "--sign-by-places"]) == 2
    err = capsys.readouterr().err
    assert "saved at step 1" in err and "steps 3 -> 4" in err and "sign_by_places False -> True" in err
    assert "seed" not in err.split("options (")[1]             # only what differs is named
    assert (out / "train_state.pt").read_bytes() == state    # and the state is left as it was

    assert main(["--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "there is no train_state.pt" in capsys.readouterr().err

    # a state saved before --doc-labels-first existed has no such key: it was a run without it
    from k3chat.demo.train import load_resume_state, run_recipe
    old = torch.load(out / "train_state.pt", weights_only=False)
    del old["recipe"]["doc_labels_first"]
    torch.save(old, out / "train_state.pt")
    recipe = dict(old["recipe"], doc_labels_first=False)
    assert load_resume_state(torch, out / "train_state.pt", recipe)["step"] == 1
    assert main([*base, "--steps", "3", "--doc-labels-first"]) == 2
    assert "doc_labels_first False -> True" in capsys.readouterr().err
    assert main([*base, "--steps", "3", "--compile"]) == 2         # compiled steps round otherwise
    assert "compile False -> True" in capsys.readouterr().err
    assert set(recipe) == set(run_recipe(steps=3, seed=5, conversations=30, batch_tokens=256, lr=1e-3,
                                         final_lr=0.1, tie_embeddings=False, copy_warmup=0, copy_mix=0,
                                         copy_mix_from=0, copy_mix_until=0, copy_words_only=False,
                                         count_weight=1.0))

    (out / "train_state.pt").write_bytes(state[: len(state) // 2])
    assert main([*base, "--steps", "3"]) == 2
    assert "cannot be read" in capsys.readouterr().err

    torch.save({"model": {}, "step": 1}, out / "train_state.pt")
    assert main([*base, "--steps", "3"]) == 2
    assert "has no opt, history, recipe" in capsys.readouterr().err


def test_init_from_starts_from_the_checkpoints_weights_and_tokenizer(tmp_path: Path) -> None:
    """--init-from trains on from the weights a run wrote: at a rate too small to move them,
    the second run writes the first one's tensors back (router biases, which the balancing
    moves by 1e-3 a step whatever the rate, within that), with its tokenizer as it was, and
    training.json counts both runs' time. Started from random weights instead, the same
    run's tensors are far from them, so the check can fail."""
    import json

    from k3chat.demo.train import train
    from k3engine import mxfp4
    from k3engine.oracle import Checkpoint

    opts = dict(seed=5, conversations=30, batch_tokens=256, threads=1, resume=False)
    first = train(tmp_path / "a", steps=3, lr=1e-3, **opts)
    again = train(tmp_path / "b", steps=2, lr=1e-12, init_from=tmp_path / "a", **opts)
    fresh = train(tmp_path / "c", steps=2, lr=1e-12, **dict(opts, seed=6))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, b, c = (Checkpoint(tmp_path / d) for d in "abc")
    names = [n for n in a.names() if not n.endswith("e_score_correction_bias")]
    assert len(names) > 50

    def value(ck: Checkpoint, n: str) -> np.ndarray:
        # an expert matrix by its decoded values: a group whose largest value decoded to 3 times
        # its scale is written again at half the scale, the same values in other bytes
        if n.endswith(".weight_scale"):
            n = n[: -len("scale")] + "packed"
        if n.endswith(".weight_packed"):
            return mxfp4.decode(ck.tensor(n), ck.tensor(n[: -len("packed")] + "scale"))[0]
        return ck.tensor(n)

    for n in names:     # F32 tensors (the short convolutions) near 0 do move by the 1e-12 steps
        assert np.allclose(value(a, n), value(b, n), rtol=0, atol=1e-9), n
    for n in a.names():
        if n.endswith("e_score_correction_bias"):
            # two balancing steps of 1e-3, then the stored rounding
            assert np.abs(a.tensor(n).astype(np.float64) - b.tensor(n)).max() <= 2.1e-3, n
    def far(x: np.ndarray, y: np.ndarray) -> bool:     # (a tokenizer learnt anew may differ in size)
        return x.shape != y.shape or not np.allclose(x, y, rtol=0, atol=1e-3)

    assert sum(far(value(a, n), value(c, n)) for n in names) > len(names) // 2
    assert again["init_from"]["seed"] == 5 and again["init_from"]["steps"] == 3
    assert again["train_seconds_total"] == round(again["train_seconds"] + first["train_seconds"], 1)
    assert fresh["init_from"] is None and fresh["train_seconds_total"] == fresh["train_seconds"]
    assert json.loads((tmp_path / "b" / "training.json").read_text())["init_from"]["train_seconds"] == \
        first["train_seconds"]


def test_step_bench_times_both_sides_and_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark behind README's --compile ratio runs end to end on a tiny budget and
    writes what it printed (no speed is asserted: only that both sides were timed)."""
    _compile_or_skip()
    import json

    from k3chat.demo import step_bench

    out = tmp_path / "bench.json"
    assert step_bench.main(["--steps", "2", "--warmup", "1", "--threads", "1", "--batch-tokens", "256",
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["seconds_per_step"]
    assert res["steps"] == 2 and set(s) == {"eager", "compiled"} and min(s.values()) > 0
    assert res["compiled_speedup"] == pytest.approx(s["eager"] / s["compiled"], rel=1e-2)
    assert f"{s['eager']:.3f} s/step" in capsys.readouterr().out
    assert step_bench.main(["--steps", "0"]) == 2


def test_recall_probe_reports_lookup_accuracy_per_learning_rate(tmp_path: Path) -> None:
    """python -m k3chat.demo.recall_probe end to end, tiny: one run per lr, a curve of shares."""
    import json

    from k3chat.demo import recall_probe

    out = tmp_path / "probe.json"
    assert recall_probe.main(["--lr", "1e-3,3e-4", "--steps", "3", "--rows", "2", "--threads", "1",
                              "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["lr"] for r in res["runs"]] == [1e-3, 3e-4] and res["steps"] == 3
    for run in res["runs"]:
        assert len(run["lookup_accuracy_every_25"]) == 1
        assert 0.0 <= run["final_lookup_accuracy"] <= 1.0 and run["final_loss"] > 0
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    assert res["ffn_lr"] == 1.0 and "feed-forward" not in recall_probe.format_report(res)


def test_recall_probe_ffn_lr_scales_exactly_the_feed_forward_weights(tmp_path: Path) -> None:
    """--ffn-lr 0.5: every weight once, the dense MLP's, routers' and experts' at half the
    rate and the rest at the rate; the report and the JSON say so."""
    import json

    from k3chat.demo import recall_probe
    from k3chat.demo.train import DEMO_PRESET

    model = K3Torch(DEMO_PRESET, 300, seed=0)
    scale = {id(p): g["lr_scale"] for g in recall_probe._groups(model, 0.5) for p in g["params"]}
    assert len(scale) == len(list(model.parameters()))
    for name, p in model.named_weights():
        assert scale[id(p)] == (0.5 if ".mlp." in name or ".block_sparse_moe." in name else 1.0), name
    out = tmp_path / "probe.json"
    assert recall_probe.main(["--lr", "1e-3", "--ffn-lr", "0.5", "--steps", "2", "--rows", "2",
                              "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ffn_lr"] == 0.5 and res["runs"][0]["ffn_lr"] == 0.5
    assert "feed-forward weights at 0.5 of the rate" in recall_probe.format_report(res)



def test_compiled_kernels_allow_more_graphs_than_dynamos_default() -> None:
    """Past dynamo's recompile limit (8 by default) a compiled piece silently runs eager for each
    new variant; a train-demo --copy-mix run met more than 8 for attn_res and rmsnorm."""
    import torch._dynamo

    from k3engine.train.model import Kernels

    cfg = torch._dynamo.config
    before = cfg.recompile_limit
    try:
        cfg.recompile_limit = 8
        Kernels(compiled=False)
        assert cfg.recompile_limit == 8                 # eager leaves dynamo alone
        Kernels(compiled=True)
        assert cfg.recompile_limit >= Kernels.RECOMPILE_LIMIT >= 32
    finally:
        cfg.recompile_limit = before
