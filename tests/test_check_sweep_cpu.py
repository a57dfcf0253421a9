"""tools/check_sweep.py: it finds the input checks of _ops.py and takes out exactly one
condition at a time (the sweep itself runs the suite once a check: too long for CI)."""
import ast
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import check_sweep as cs  # noqa: E402


def test_every_check_is_found_and_taken_out_alone():
    source = (cs.PACKAGE / "_ops.py").read_text()
    found = cs.checks(source)
    assert len(found) >= 50
    lines = [c.args[0].lineno for c in found]
    assert lines == sorted(lines)
    for call in found:
        mutated = cs.without(source, call)
        tree = ast.parse(mutated)  # still Python
        conds = [n.args[0] for n in cs.checks(mutated)]
        trues = [c for c in conds if isinstance(c, ast.Constant) and c.value is True]
        assert len(conds) == len(found) and len(trues) == 1, ast.get_source_segment(source, call)
        assert ast.dump(tree) != ast.dump(ast.parse(source))


def test_a_check_written_over_lines_is_replaced_whole():
    source = "def f(c, x):\n    c.value(x > 0 and\n            x < 9, 'x in (0, 9)')\n"
    (call,) = cs.checks(source)
    assert cs.without(source, call) == "def f(c, x):\n    c.value(True, 'x in (0, 9)')\n"


def test_native_checks_are_found_with_their_whole_condition():
    source = ('c.expect(f(a, b) && s == "x,)", "msg")\n'
              '    .expect(n > 0 &&  // why\n            m < 2, "m")\n'
              '    .expect(p || q && r, "mixed");\n')
    spans = cs.native_checks(source)
    assert [source[b:e] for b, e in spans] == ['f(a, b) && s == "x,)"',
                                               "n > 0 &&  // why\n            m < 2",
                                               "p || q && r"]
    parts = [source[b:e] for span in spans for b, e in cs.clauses(source, span)]
    assert parts == ["f(a, b)", 's == "x,)"', "n > 0", "m < 2", "p || q && r"]
    assert cs.native_without(source, spans[1]).splitlines()[1] == '    .expect(true, "m")'


def test_every_native_check_of_the_library_is_found():
    for pattern in cs.NATIVE_SOURCES:
        for path in cs.ROOT.glob(pattern):
            source = path.read_text()
            spans = cs.native_checks(source)
            assert len(spans) == source.count(".expect("), path
            for span in spans:
                for b, e in cs.clauses(source, span):
                    assert source[b:e].strip() and "//" not in source[b:e], (path, source[b:e])
