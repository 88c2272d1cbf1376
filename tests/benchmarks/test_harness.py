"""corral.benchmarks.harness and the `corral bench` entry point: the server runs without the `bench` extra, every bench
parser builds without it, a bench run without it says how to install it, and the shared pieces behave."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.benchmarks.harness import (
    DATA_HELP,
    Bench,
    BenchExit,
    ServerBenchConfig,
    bench_command,
    config_from_args,
    exit_on,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]
BENCH_EXTRA = ("rich", "matplotlib", "httpx")
COMMANDS = ("jsonschemabench", "serve", "peer-model", "tools", "sampler", "projection", "prefix", "engine",
            "mediation", "startup", "fuzz", "soak", "quality", "kinds", "paired", "agree", "drafts")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


def _loaded_after(argv: list[str], modules: tuple[str, ...]) -> list[str]:
    """The `modules` imported once `corral ARGV` has built its parser (--help ends it there)."""
    done = _python(f"""
import contextlib, io, sys
import corral.server.cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    corral.server.cli.main({argv!r})
print(",".join(m for m in {modules!r} if m in sys.modules))
""")
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]


def test_server_imports_no_benchmark_package() -> None:
    done = _python(f"""
import sys
import corral.server.cli, corral.server.app, corral.server.serving
print(",".join(m for m in {(*BENCH_EXTRA, "corral.benchmarks")!r} if m in sys.modules))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
    # `corral serve` builds the whole parser, the `bench` entry included, without loading corral/benchmarks/
    assert _loaded_after(["serve", "--help"], (*BENCH_EXTRA, "corral.benchmarks")) == []


def test_bench_parser_needs_no_benchmark_package() -> None:
    """Each command's parser in turn in one process (a module stays loaded: the first command that loads it
    is the one named)."""
    modules = (*BENCH_EXTRA, "torch")
    done = _python(f"""
import contextlib, io, json, sys
import corral.server.cli
loaded = {{}}
for command in {COMMANDS!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        corral.server.cli.main(["bench", command, "--help"])
    loaded[command] = [m for m in {modules!r} if m in sys.modules]
print(json.dumps(loaded))
""")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {command: [] for command in COMMANDS}


def test_bench_without_the_extra_says_how_to_install_it() -> None:
    done = _python("""
import sys
sys.modules["matplotlib"] = None  # as if not installed: find_spec and import both fail
from corral.server.cli import main
raise SystemExit(main(["bench", "sampler"]))
""")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "pip install 'corral[bench]'" in done.stderr and "matplotlib" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


Runs = list[tuple[argparse.Namespace, Bench]]


def _parser(**common: object) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, Runs]:
    """`corral toy`, a bench_command with the `common` flags; its handler records each run."""
    runs: Runs = []

    def run(args: argparse.Namespace, bench: Bench) -> int:
        runs.append((args, bench))
        if args.fail:
            with exit_on(RuntimeError, 1):
                raise RuntimeError("the server went away")
        return 0

    parser = argparse.ArgumentParser(prog="corral")
    sub = parser.add_subparsers(dest="command", required=True)
    with bench_command(sub, "toy", run, help="h", description="d", **common) as toy:  # type: ignore[arg-type]
        toy.add_argument("--fail", action="store_true")
    return parser, toy, runs


def test_bench_command_adds_the_common_flags_it_is_given(tmp_path: Path) -> None:
    parser, toy, _ = _parser(data=DATA_HELP, server="s", server_args="a", server_args_default="--x 1",
                        out="bench-out/toy", log_level=True)
    args = parser.parse_args(["toy", "--data", str(tmp_path)])
    assert (args.data, args.server, args.server_args, args.out, args.log_level) == (
        tmp_path, None, "--x 1", Path("bench-out/toy"), "warning")
    assert "results folder (default bench-out/toy)" in toy.format_help()
    bare, _, _ = _parser(out="o")
    assert set(vars(bare.parse_args(["toy"]))) == {"command", "fail", "out", "handler"}


def test_handler_runs_checks_data_and_turns_failures_into_exit_codes(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    parser, _, runs = _parser(data=DATA_HELP, out=str(tmp_path / "out"))
    args = parser.parse_args(["toy", "--data", str(tmp_path)])
    assert args.handler(args) == 0 and runs[0][1].plot_path == tmp_path / "out" / "toy.png"
    args = parser.parse_args(["toy", "--data", str(tmp_path), "--fail"])
    assert args.handler(args) == 1
    assert "corral bench toy: the server went away" in capsys.readouterr().out
    args = parser.parse_args(["toy", "--data", str(tmp_path / "missing")])
    assert args.handler(args) == 2 and len(runs) == 2  # refused before the run
    assert "is not a directory" in capsys.readouterr().out


def test_bench_report_writes_results_and_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    bench = Bench("toy", Console(width=100), tmp_path)
    bench.table("the title", ["name", "value"], [["a", "1"], ["b", "22"]])
    path = bench.write_results({"n": 2}, [{"a": 1}])
    bench.wrote(path, bench.plot_path, wall_s=1.25)
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["config"] == {"n": 2} and saved["results"] == [{"a": 1}] and "python" in saved["machine"]
    printed = capsys.readouterr().out
    assert "the title" in printed and "22" in printed
    assert f"wall time 1.2 s; wrote {path}, {tmp_path / 'toy.png'}" in printed.replace("\n", "")
    other = write_json(tmp_path / "deeper", {"path": tmp_path, "text": "µs"}, name="x.json")
    assert other.read_text(encoding="utf-8").endswith("\n") and json.loads(other.read_text())["text"] == "µs"


def test_config_from_args_takes_the_flags_named_as_fields(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class Config(ServerBenchConfig):
        schemas: int = 3
        levels: tuple[int, ...] = ()

    args = argparse.Namespace(data=tmp_path, out=tmp_path / "o", server=None, server_args="", schemas=5,
                              levels="1,2", handler=None)
    config = config_from_args(Config, args, levels=(1, 2))
    assert config == Config(tmp_path, tmp_path / "o", None, "", 5, (1, 2))
    assert config.as_dict()["out"] == str(tmp_path / "o")
    assert config.server_notes("http://x", ["corral"])["started_by_benchmark"] is True


def test_bench_exit_carries_code_and_style() -> None:
    with pytest.raises(BenchExit) as caught, exit_on((ValueError, OSError), 2):
        raise OSError("no such file")
    assert (str(caught.value), caught.value.code, caught.value.style) == ("no such file", 2, "red")
