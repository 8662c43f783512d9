"""The README's headline figures are the record's: every figure in a headline row appears in the
docs/BENCHMARKS.md section of each `l2l bench` command the row names, so a new record that
changes a figure fails here until the headline follows it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`l2l bench ([\w-]+)[ `]|`(\w[\w-]*)`\)")  # "(`l2l bench precision`, `eps`)"
FIGURE = r"(?<![\d.]){}(?![\d])"


def headline_rows() -> list[list[str]]:
    table = (ROOT / "README.md").read_text().split("## Headline figures")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ")]
    return rows[2:]  # past the header and its rule


def record_sections() -> dict[str, str]:
    sections: dict[str, str] = {}
    for part in ("\n" + (ROOT / "docs" / "BENCHMARKS.md").read_text()).split("\n## ")[1:]:
        heading = re.match(r"`l2l bench ([\w-]+)", part)
        if heading:
            sections[heading.group(1)] = sections.get(heading.group(1), "") + part
    return sections


def test_every_headline_figure_is_in_the_record_of_the_command_it_names():
    sections, rows = record_sections(), headline_rows()
    assert len(rows) >= 10
    stale = []
    for what, *figures in rows:
        commands = [a or b for a, b in COMMAND.findall(what)]
        assert commands and all(c in sections for c in commands), (what, commands)
        record = "\n".join(sections[c] for c in commands)
        for number in re.findall(r"\d+\.\d+", " ".join(figures)):
            if not re.search(FIGURE.format(re.escape(number)), record):
                stale.append(f"{number} ({what})")
    assert not stale, f"headline figures not in docs/BENCHMARKS.md: {stale}"


def test_the_check_finds_a_figure_the_record_does_not_hold():
    record = record_sections()["relay"]
    assert re.search(FIGURE.format(re.escape("1.02")), record)
    assert not re.search(FIGURE.format(re.escape("1.0")), "ratio 1.02")  # a figure is matched whole


def test_the_readme_lists_every_benchmark_command():
    from l2l_hw.cli import BENCHES

    listed = re.search(r"`l2l bench ([\w|-]+) --json`", (ROOT / "README.md").read_text()).group(1).split("|")
    assert sorted(listed) == sorted(BENCHES)


def test_every_doc_the_readme_layout_names_exists_and_every_doc_is_named():
    layout = (ROOT / "README.md").read_text().split("## Layout")[1]
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [d for d in docs if d not in layout] == []
    assert "../shared" not in (ROOT / "README.md").read_text()
