"""The house rules that drift, checked on the source: product files stay under 500 lines and the README under
20 KB; no module keeps behaviour in globals that a setter changes (`global` statements); the KV cache is read by
attribute, never by string key; measured figures live in docs/, not in the code's comments and docstrings."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("dsv41", "pallas_kernels", "serving", "sharding")
MAX_LINES = 500
MAX_README_BYTES = 20_000
# a duration or a rate ("2.3 ms", "1,255 GFLOP/s", "~10 ms"), or a speed ratio ("3x slower", "0.23x XLA's")
FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|ns|s|GB/s|MB/s|GFLOP/s|TFLOP/s|tok/s)(?![\w/])"
                    r"|\b\d+(?:\.\d+)?x (?:faster|slower|the|XLA)")
MAX_FIGURE_LINES = 5  # outside serving/bench (benchmarks report figures) and docs/


def product_files(*, benchmarks: bool = True) -> list[Path]:
    files = [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in files if benchmarks or "bench" not in p.relative_to(ROOT).parts]


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of a docstring-like string."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.splitlines())]
    return out


def test_no_product_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in product_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_readme_stays_an_entry_point():
    assert (ROOT / "README.md").stat().st_size <= MAX_README_BYTES


def test_no_module_global_behaviour_setters():
    setters = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in product_files()
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Global)]
    assert setters == []


def test_the_kv_cache_is_read_by_attribute():
    keyed = [f"{p.relative_to(ROOT)}:{n}" for p in product_files() for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bcache\w*\[\s*[\"']", line)]
    assert keyed == []


def test_measured_figures_live_in_docs():
    figures = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in product_files(benchmarks=False)
               for n, line in comment_lines(p) if FIGURE.search(line)]
    assert len(figures) <= MAX_FIGURE_LINES, "\n".join(figures)


def test_the_checks_see_what_they_look_for(tmp_path):
    """Each pattern finds its case, so an empty result above means the code has none."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Runs 2.3 ms here."""\nx = cache["swa"]  # 3x slower\n\n\ndef f():\n    global x\n')
    assert [n for n, line in comment_lines(sample) if FIGURE.search(line)] == [1, 2]
    assert re.search(r"\bcache\w*\[\s*[\"']", sample.read_text())
    assert any(isinstance(node, ast.Global) for node in ast.walk(ast.parse(sample.read_text())))
