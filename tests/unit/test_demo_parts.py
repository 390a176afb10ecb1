"""The demo's parts on their own, in one process: corpus, vocabulary, windows, model, sampling,
the loss-curve PNG (matplotlib), and the command-line plumbing (nothing is launched here)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from trainmesh.demo import CharGPT, CharVocab, CharWindows, GPTConfig, build_corpus, generate, lm_loss
from trainmesh.demo.corpus import UNKNOWN_CHAR, select_sources
from trainmesh.demo.generate import sample_ids
from trainmesh.demo.job import DemoSettings, draw_curves, parse_args
from trainmesh.launcher import demo as demo_cmd
from trainmesh.launcher.run import torchrun_argv

pytestmark = pytest.mark.timeout(120)

SMALL_BUDGET = 40_000


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(SMALL_BUDGET, max_file_chars=4_000)


def tiny_model(vocab_size: int, *, block_size: int = 16, seed: int = 0) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, d_model=32))


def color_pixels(image, hex_color: str, tol: float = 0.02) -> int:
    """How many pixels of an RGB(A) float image are ``hex_color`` (within ``tol`` per channel)."""
    rgb = torch.tensor([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    pixels = torch.as_tensor(image[..., :3])
    return int(((pixels - rgb).abs() <= tol).all(dim=-1).sum())


# --- corpus ---------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_split_by_file(corpus) -> None:
    again = build_corpus(SMALL_BUDGET, max_file_chars=4_000)
    assert (again.train_text, again.heldout_text, again.vocab.chars) == (
        corpus.train_text,
        corpus.heldout_text,
        corpus.vocab.chars,
    )
    assert corpus.train_files and corpus.heldout_files
    # Held out are the last files of a sorted selection, disjoint from the training files.
    names = list(corpus.train_files) + list(corpus.heldout_files)
    assert names == sorted(names) and not set(corpus.train_files) & set(corpus.heldout_files)
    total = len(corpus.train_text) + len(corpus.heldout_text)
    assert SMALL_BUDGET // 2 < total <= SMALL_BUDGET + 2 * len(names)  # + the blank lines between modules
    assert "def " in corpus.train_text and "import" in corpus.train_text


def test_corpus_from_a_given_directory(tmp_path: Path) -> None:
    for i, name in enumerate("abcdefghij"):
        (tmp_path / f"{name}.py").write_text(f"# module {name}\n" + "x = 1\n" * (10 + i))
    (tmp_path / "notes.txt").write_text("not python")
    c = build_corpus(10_000, root=tmp_path, min_char_count=1)
    assert c.train_files == tuple(f"{n}.py" for n in "abcdefghi") and c.heldout_files == ("j.py",)
    assert c.train_text.startswith("# module a\n") and c.heldout_text.startswith("# module j\n")
    # The 10 files hold 980 characters: a budget of 300 strides through every third file.
    files = select_sources(tmp_path, 300, 10_000)
    assert [p.name for p in files] == ["a.py", "d.py", "g.py", "j.py"]
    with pytest.raises(FileNotFoundError):
        build_corpus(1000, root=tmp_path / "missing")


def test_files_are_cut_at_line_ends(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("line\n" * 1000)
    c = build_corpus(100_000, root=tmp_path, max_file_chars=52, min_char_count=1)
    assert c.train_text == "line\n" * 10 and c.heldout_text == "line\n" * 10


# --- vocabulary and windows -----------------------------------------------------------------
def test_vocab_round_trip_and_unknown(corpus) -> None:
    vocab = corpus.vocab
    assert vocab.chars == sorted(vocab.chars) and len(vocab) == len(vocab.chars) + 1
    text = corpus.train_text[:2000]
    assert all(c in vocab.chars for c in "def return\n ()")
    ids = vocab.encode(text)
    assert ids.dtype == torch.long and int(ids.min()) >= 0 and int(ids.max()) < len(vocab)
    expected = "".join(c if c in vocab.chars else UNKNOWN_CHAR for c in text)
    assert vocab.decode(ids) == expected
    assert vocab.decode(vocab.encode("a\u2603b")) == f"a{UNKNOWN_CHAR}b"
    assert CharVocab.from_json(vocab.to_json()).chars == vocab.chars
    assert CharVocab.from_text("aab", min_count=2).chars == ["a"]


def test_windows_shapes_and_shift() -> None:
    ids = torch.arange(100)
    windows = CharWindows(ids, block_size=8)
    assert len(windows) == 12  # 12 * 8 + 1 <= 100 < 13 * 8 + 1
    x, y = windows[3]
    assert x.shape == y.shape == (8,) and x.dtype == torch.long
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    assert windows[-1][1][-1] == 96
    strided = CharWindows(ids, block_size=8, stride=4)
    assert len(strided) == 23 and strided[1][0][0] == 4
    with pytest.raises(IndexError):
        windows[12]
    with pytest.raises(ValueError):
        CharWindows(torch.arange(8), block_size=8)
    train, heldout = build_corpus(SMALL_BUDGET, max_file_chars=4_000).datasets(32)
    assert len(train) > len(heldout) > 0 and train[0][0].shape == (32,)


# --- model -----------------------------------------------------------------------------------
def test_forward_shapes_and_tied_head() -> None:
    model = tiny_model(50)
    logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50)
    assert model(torch.randint(0, 50, (2, 5))).shape == (2, 5, 50)  # shorter than block_size
    assert model.head.weight is model.tok_emb.weight
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, d_model=30, n_head=4)


def test_attention_is_causal() -> None:
    model = tiny_model(50).eval()
    ids = torch.randint(0, 50, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    # Changing position 10 must leave every earlier position's logits exactly as they were...
    assert torch.equal(a[0, :10], b[0, :10])
    # ...and change position 10 itself (the model is not ignoring its input).
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_low_precision_short_attention_takes_the_math_kernel_with_the_same_result(monkeypatch) -> None:
    from trainmesh.demo import char_gpt

    model = tiny_model(50)
    ids = torch.randint(0, 50, (4, 16))
    calls = []
    original = char_gpt.sdpa_kernel
    monkeypatch.setattr(char_gpt, "sdpa_kernel", lambda *a, **k: calls.append(a) or original(*a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        math_out = model(ids)
        math_out.float().sum().backward()
    assert len(calls) == 2  # one per block, only under low precision at T <= MATH_ATTENTION_MAX_T
    math_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(char_gpt, "MATH_ATTENTION_MAX_T", 0)  # torch's own kernel choice
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flash_out = model(ids)
        flash_out.float().sum().backward()
    assert len(calls) == 2
    # The same function, up to bf16 rounding (8-bit mantissa: ~1e-2 relative).
    torch.testing.assert_close(math_out.float(), flash_out.float(), atol=3e-2, rtol=3e-2)
    for a, p in zip(math_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=5e-2 * float(p.grad.abs().max()) + 1e-3, rtol=5e-2)
    model(ids)  # fp32: torch's choice, no override
    assert len(calls) == 2


def test_loss_at_init_and_under_bf16_autocast() -> None:
    model = tiny_model(50)
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    loss = lm_loss(model(x), y)
    # Small initial weights: predictions near uniform, loss near log(V).
    assert abs(loss.item() - math.log(50)) < 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(x)
        bf16_loss = lm_loss(outputs, y)
    assert outputs.dtype == torch.bfloat16 and bf16_loss.dtype == torch.float32


def test_a_few_plain_steps_reduce_the_loss(corpus) -> None:
    train, _ = corpus.datasets(16)
    model = tiny_model(len(corpus.vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = [train[i] for i in range(32)]
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    losses = []
    for _ in range(30):
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


# --- generation ------------------------------------------------------------------------------
class Wrapper(torch.nn.Module):
    """Stands in for DDP: the model under ``.module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def test_generation_is_seeded_and_leaves_the_model_alone(corpus) -> None:
    vocab = corpus.vocab
    model = tiny_model(len(vocab), block_size=8)
    rng_before = torch.get_rng_state()
    text = generate(model, vocab, "def ", 40, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)  # a private generator
    assert model.training  # restored after eval-mode sampling
    assert text.startswith("def ") and len(text) == 44  # longer than block_size: the context is cropped
    assert generate(Wrapper(model), vocab, "def ", 40, seed=3) == text
    assert {generate(model, vocab, "def ", 40, seed=s) for s in range(4)} != {text}
    greedy = sample_ids(model, vocab.encode("def "), 10, temperature=0)
    assert torch.equal(sample_ids(model, vocab.encode("def "), 10, top_k=1, seed=9), greedy)
    with pytest.raises(ValueError):
        sample_ids(model, torch.tensor([], dtype=torch.long), 5)


# --- the loss curve (matplotlib) and the job's helpers --------------------------------------------
def _write_logs(log_dir: Path) -> None:
    from trainmesh.trainer.log_writer import LogWriter

    with LogWriter(log_dir, tensorboard=False) as writer:
        for step in range(1, 41):
            writer.log_step(
                {"epoch": (step - 1) // 20, "global_step": step, "loss": 3 - step / 20, "samples_per_s": 100.0 + step}
            )
        for epoch in range(2):
            writer.log_epoch({"epoch": epoch, "loss": 2.5 - epoch, "val_loss": 2.6 - epoch})


def test_draw_curves_writes_a_matplotlib_png(tmp_path: Path) -> None:
    image_mod = pytest.importorskip("matplotlib.image", reason="matplotlib is in the `test` and `demo` extras")
    _write_logs(tmp_path / "logs")
    png = tmp_path / "curve.png"
    assert draw_curves(tmp_path / "logs", png) == "matplotlib"
    assert b"Matplotlib version" in png.read_bytes()[:200]  # the Software text chunk matplotlib writes
    image = image_mod.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 500 and image.shape[2] in (3, 4)
    # Not blank: the step loss (tab:blue), the held-out markers (tab:green) and the throughput
    # (tab:purple) are all drawn.
    assert color_pixels(image, "#1f77b4") > 200
    assert color_pixels(image, "#2ca02c") > 20
    assert color_pixels(image, "#9467bd") > 100


def test_draw_curves_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    _write_logs(tmp_path / "logs")
    # A None entry in sys.modules makes `import matplotlib...` fail as if it were not installed.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert draw_curves(tmp_path / "logs", tmp_path / "curve.png") is None
    assert not (tmp_path / "curve.png").exists()
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install -e '.[demo]'" in err and "trainmesh plot" in err


def test_settings_and_job_arguments() -> None:
    full = DemoSettings.full()
    assert [full.global_batch_for(n) for n in (1, 2, 4, 8)] == [128] * 4
    assert full.global_batch_for(3) == 129  # rounded up to a multiple of accumulation (1) x processes
    quick = DemoSettings.quick()
    assert quick.char_budget < full.char_budget and quick.d_model < full.d_model
    args = parse_args(["--quick", "--epochs", "1", "--out", "x"])
    assert (args.quick, args.epochs, args.out) == (True, 1, "x")
    with pytest.raises(SystemExit):
        parse_args(["--epochs", "0"])


def test_demo_command_delegates_to_run() -> None:
    holder = argparse.ArgumentParser()
    parser = demo_cmd.add_parser(holder.add_subparsers())
    args = parser.parse_args([])
    assert (args.nproc_per_node, args.out, args.epochs, args.quick) == (None, "trainmesh-demo", None, False)
    # -n left out: one process per GPU where there are GPUs (NCCL drives one each), else 4
    gpus = torch.cuda.device_count()
    assert demo_cmd._resolve_nproc(args).nproc_per_node == (gpus or 4)
    assert demo_cmd._resolve_nproc(parser.parse_args(["-n", "3"])).nproc_per_node == 3
    run_args, _ = demo_cmd.run_args(parser.parse_args(["-n", "2", "--quick", "--out", "o", "--epochs", "1"]))
    assert torchrun_argv(run_args) == [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "1",
        "--standalone",
        "--module",
        "trainmesh.demo.job",
        "--out",
        "o",
        "--epochs",
        "1",
        "--quick",
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["-n", "0"])


def test_demo_is_a_registered_command() -> None:
    from trainmesh.launcher import cli

    assert demo_cmd in cli.COMMANDS
    args = cli.build_parser().parse_args(["demo", "--quick"])
    assert args.handle is demo_cmd.handle
