"""``refcheck report``: the HTML page of a diffed trace reads back what the Report says, and links only to itself.

Three goldens, each diffed once (replay: the page does not depend on the mode): a passing one, a failing
SGLang one (layer sketches: the failing nodes carry per-layer numbers) and a sampled one. The page is parsed
with the standard library's HTML parser. The command itself runs in-process with the diff stubbed by the
fixture's report (its exit code and file), and on bad input (a flipped byte: exit 4; an output directory
that does not exist: exit 2 before any diff). The page of several cases (``refcheck gate --html``,
``refcheck diff --html``) holds the passing and the failing golden, the gate's over a golden directory of
those two with its verdicts stubbed by the fixture's reports: an index whose links resolve, ids unique across
the cases, the failing case's failing nodes marked, a trace that cannot be read said so, the per-page caps.
The browser tests screenshot the failing page and a gate page with headless Chromium when one is installed,
and follow a case link of the gate page's index.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from refcheck.diff.findings import Report
from refcheck.diff.judge import judge
from refcheck.pool import ReferencePool
from refcheck.report import TokenText, render_page
from refcheck.trace.io import read_trace
from refcheck.trace.rows import Trace

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("report_html")]

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = {"pass": "attention-b15.arrow", "fail": "sglang-hybrid-ddtree-b15-leaky-chain.arrow",
           "sampled": "hybrid-b15-t1.arrow"}
VOID = {"meta", "br", "hr", "img", "input", "link", "source", "wbr", "col", "area", "base", "embed"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    ancestors: list[Element]
    text: str = ""

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


@dataclass
class Page(HTMLParser):
    elements: list[Element] = field(default_factory=list)
    stack: list[Element] = field(default_factory=list)

    def __post_init__(self) -> None:
        HTMLParser.__init__(self)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, list(self.stack))
        self.elements.append(el)
        if tag not in VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}, list(self.stack)))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.stack.pop().tag == tag:
                break

    def handle_data(self, data: str) -> None:
        for el in self.stack:
            el.text += data

    def ids(self) -> dict[str, Element]:
        return {el.attrs["id"]: el for el in self.elements if "id" in el.attrs}

    def within(self, ident: str) -> list[Element]:
        return [el for el in self.elements if any(a.attrs.get("id") == ident for a in el.ancestors)]


@dataclass
class Rendered:
    name: str
    report: Report
    trace: Trace
    html: str
    page: Page


@pytest.fixture(scope="module")
def pool() -> ReferencePool:
    return ReferencePool()


@pytest.fixture(scope="module")
def pages(pool) -> Callable[[str], Rendered]:
    """pages(name): the golden's diff and page, made once per module."""
    done: dict[str, Rendered] = {}

    def get(name: str) -> Rendered:
        if name not in done:
            path = ROOT / "golden" / GOLDENS[name]
            trace = read_trace(path)
            report = judge(trace, pool, path.stem, "replay")
            html = render_page(report, trace, TokenText.for_trace(trace.provenance))
            page = Page()
            page.feed(html)
            page.close()
            done[name] = Rendered(name, report, trace, html, page)
        return done[name]

    return get


@pytest.fixture(params=list(GOLDENS))
def rendered(request, pages) -> Rendered:
    return pages(request.param)


def test_the_summary_shows_the_reports_verdict_and_counts(rendered):
    ids = rendered.page.ids()
    assert ids["verdict"].text.strip() == rendered.report.verdict
    assert rendered.report.verdict == ("fail" if rendered.name == "fail" else "pass")
    cells = {el.attrs["data-verdict"]: el for el in rendered.page.within("counts") if "data-verdict" in el.attrs}
    counts = rendered.report.counts
    assert set(cells) == {"pass", "benign_tie", "triaged", "fail", "unsupported", "skipped"}
    for verdict, el in cells.items():
        assert el.text.split()[-1] == str(counts[verdict]), verdict
    if rendered.report.stats.get("mean_tau_engine") is not None:
        assert "mean τ engine" in ids["tau"].text
    assert rendered.trace.provenance["engine"]["name"] in ids["provenance"].text


def test_every_verify_step_has_a_strip_cell_linking_to_its_detail(rendered):
    ids = rendered.page.ids()
    for i, req in enumerate(rendered.trace.requests):
        steps = sorted(s.step for s in rendered.trace.steps if s.request_id == req.request_id)
        cells = [el for el in rendered.page.within(f"q{i}") if "cell" in el.classes]
        assert [int(el.attrs["data-step"]) for el in cells] == steps
        for el, step in zip(cells, steps):
            assert el.attrs["href"] == f"#q{i}-s{step}" and f"q{i}-s{step}" in ids
        assert f"q{i}-s{steps[0]}-n0" in ids  # the first step's tree is drawn


def test_the_failing_steps_tree_marks_the_failing_node(pages):
    rendered = pages("fail")
    ids = rendered.page.ids()
    order = [r.request_id for r in rendered.trace.requests]
    nodes = [(rid, f) for rid, f in rendered.report.first_divergence().items() if f.node is not None]
    assert nodes
    for rid, f in nodes:
        el = ids[f"q{order.index(rid)}-s{f.step}-n{f.node}"]
        assert "fail" in el.classes and "node" in el.classes
        assert any(a.tag == "svg" for a in el.ancestors)
        assert f"node {f.node}" in el.text and "fail logits" in el.text  # the <title> tooltip
    charts = [el for el in rendered.page.elements if el.tag == "svg" and "bars" in el.classes]
    assert charts, "a layer-bisection finding draws its per-layer chart"
    assert any("first failing: layer" in el.text for el in charts)


def test_every_anchor_resolves_and_nothing_comes_from_the_network(rendered):
    ids = rendered.page.ids()
    summary_links = [el.attrs["href"] for el in rendered.page.within("summary") if "href" in el.attrs]
    assert summary_links and all(h.startswith("#") and h[1:] in ids for h in summary_links), summary_links
    if rendered.name == "fail":
        assert sum(1 for el in rendered.page.within("summary") if "first" in el.classes) == len(rendered.trace.requests)
    for el in rendered.page.elements:
        for attr in ("href", "src", "xlink:href", "action", "data"):
            value = el.attrs.get(attr)
            if value is not None and attr in ("href", "xlink:href"):
                assert value.startswith("#") and value[1:] in ids, value
            assert value is None or not value.lower().startswith(("http:", "https:", "//")), value
    assert "http://" not in rendered.html and "https://" not in rendered.html
    assert not any(el.tag in ("link", "img", "iframe") for el in rendered.page.elements)


def test_a_page_of_many_findings_caps_its_trees_and_its_list(pages, monkeypatch):
    rendered = pages("pass")
    from refcheck.diff.findings import Finding, Verdict
    from refcheck.report import page as page_module
    from refcheck.report.findings_list import FINDINGS_CAP

    monkeypatch.setattr(page_module, "TREE_CAP", 3)
    steps = rendered.trace.steps
    made_up = [Finding(Verdict.FAIL, "logits", steps[k % len(steps)].request_id, steps[k % len(steps)].step, node=1,
                       message=f"made up {k}", details={"max_abs": 0.5}) for k in range(FINDINGS_CAP + 123)]
    report = Report(case="many", mode="replay", findings=made_up)
    report.check("logits", len(made_up))
    page = Page()
    page.feed(render_page(report, rendered.trace))
    ids = page.ids()
    assert sum(1 for el in page.elements if el.tag == "svg" and "treesvg" in el.classes) == 3
    assert sum(1 for el in page.elements if el.tag == "tr" and el.attrs.get("id", "").startswith("f")) == FINDINGS_CAP
    assert "123 more not listed" in ids["findings-more"].text
    assert all(f"q{i}-s{s.step}" in ids for i, r in enumerate(rendered.trace.requests)
               for s in steps if s.request_id == r.request_id)
    assert any("tree not drawn" in el.text for el in page.elements if "brief" in el.classes)


def test_the_command_writes_the_page_and_exits_with_the_verdict(rendered, cli, tmp_path, monkeypatch):
    monkeypatch.setattr("refcheck.diff.judge.judge", lambda *a, **k: rendered.report)
    out = tmp_path / "r.html"
    code, _, err = cli("report", str(ROOT / "golden" / GOLDENS[rendered.name]), "-o", str(out))
    assert code == rendered.report.exit_code == (1 if rendered.name == "fail" else 0), err
    assert 'id="verdict"' in out.read_text()


def test_a_flipped_byte_is_exit_4_with_one_error_line(cli, tmp_path):
    bad = tmp_path / "flipped.arrow"
    data = bytearray((ROOT / "golden" / GOLDENS["pass"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    code, out, err = cli("report", str(bad), "-o", str(tmp_path / "x.html"))
    assert code == 4
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("refcheck: error:"), err
    assert not (tmp_path / "x.html").exists()


def test_an_output_in_a_missing_directory_is_exit_2_before_any_diff(cli, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the diff ran")

    monkeypatch.setattr("refcheck.diff.judge.judge", no_work)
    monkeypatch.setattr("refcheck.trace.io.read_trace", no_work)
    code, _, err = cli("report", str(ROOT / "golden" / GOLDENS["pass"]), "-o", str(tmp_path / "missing" / "x.html"))
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0], err


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html: Path, png: Path) -> None:
    """A headless Chromium screenshot of the page at ``html``, 1400 x 2000."""
    browser = chromium()
    assert browser is not None
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--screenshot={png}",
                    "--window-size=1400,2000", f"file://{html}"], check=True, capture_output=True, timeout=120)


@pytest.mark.skipif(chromium() is None, reason="no chromium or chromium-browser on PATH")
def test_a_browser_renders_the_failing_page(pages, tmp_path):
    html = tmp_path / "fail.html"
    html.write_text(pages("fail").html)
    png = tmp_path / "fail.png"
    screenshot(html, png)
    assert png.is_file() and png.stat().st_size > 10_000
    # the DOM the browser built (scripts run): the failing nodes are drawn marked, the summary's links land
    browser = chromium()
    assert browser is not None
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--dump-dom", f"file://{html}"], check=True, capture_output=True, text=True, timeout=120).stdout
    rendered = pages("fail")
    seen = Page()
    seen.feed(dom)
    seen.close()
    ids = seen.ids()
    order = [r.request_id for r in rendered.trace.requests]
    for rid, f in rendered.report.first_divergence().items():
        if f.node is not None:
            el = ids[f"q{order.index(rid)}-s{f.step}-n{f.node}"]
            assert "fail" in el.classes and any(a.tag == "svg" for a in el.ancestors)
    links = [el.attrs["href"] for el in seen.within("summary") if "href" in el.attrs]
    assert links and all(h[1:] in ids for h in links)


# -- the page of several cases: refcheck gate --html, refcheck diff --html --------------------------------
ON_PAGE = ("pass", "fail")  # the cases of the gate's and the diff's page, in this order


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def check_cases_page(html: str, cases: list[Rendered]) -> Page:
    """The page of ``cases`` (case k in ``#c<k>``): one index row per case linking to its section, unique ids,
    every link resolving, each case's verdict and its failing nodes marked under the case's own prefix."""
    page = parse(html)
    listed = [el.attrs["id"] for el in page.elements if "id" in el.attrs]
    assert len(listed) == len(set(listed)), [i for i in listed if listed.count(i) > 1][:5]
    assert all(re.match(r"c\d+(-|$)", i) for i in listed if i not in ("index", "overall", "cases")), listed[:20]
    ids = page.ids()
    rows = [el for el in page.within("cases") if el.tag == "tr"][1:]
    assert len(rows) == len(cases)
    case_links = [el.attrs["href"] for el in page.within("cases") if el.tag == "a" and re.fullmatch(r"#c\d+", el.attrs["href"])]
    assert case_links == [f"#c{k}" for k in range(len(cases))]
    for el in page.elements:
        for attr in ("href", "xlink:href"):
            if attr in el.attrs:
                assert el.attrs[attr].startswith("#") and el.attrs[attr][1:] in ids, el.attrs[attr]
    overall = "fail" if any(c.report.exit_code == 1 for c in cases) else "pass"
    assert ids["overall"].text.strip() == overall and f": {overall} ·" in html.split("</title>")[0]
    for k, c in enumerate(cases):
        assert c.report.case in ids[f"c{k}"].text
        assert ids[f"c{k}-verdict"].text.strip() == c.report.verdict
        order = [r.request_id for r in c.trace.requests]
        assert f"c{k}-q0-s{min(s.step for s in c.trace.steps if s.request_id == order[0])}" in ids
        for rid, f in c.report.first_divergence().items():
            if f.node is not None:
                el = ids[f"c{k}-q{order.index(rid)}-s{f.step}-n{f.node}"]
                assert "fail" in el.classes and "node" in el.classes and any(a.tag == "svg" for a in el.ancestors)
    assert any(c.report.first_divergence() for c in cases)
    return page


@pytest.fixture
def gate_dir(tmp_path) -> Path:
    """A golden directory of the passing and the failing golden (their manifest entries as the repository's)."""
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest

    gdir = tmp_path / "g"
    gdir.mkdir()
    manifest = load_manifest(REPO_GOLDEN)
    names = [Path(GOLDENS[n]).stem for n in ON_PAGE]
    for name in names:
        shutil.copy(REPO_GOLDEN / manifest.cases[name].file, gdir)
    manifest.cases = {n: manifest.cases[n] for n in names}
    manifest.save(gdir)
    return gdir


def stub_verdicts(monkeypatch, pages) -> list[Rendered]:
    """The gate's and the diff's verdicts are the fixture's reports (the failing golden's plain diff: it fails)."""
    by_case = {pages(n).report.case: pages(n).report for n in ON_PAGE}
    monkeypatch.setattr("refcheck.goldens.judge.check_trace", lambda name, *a, **k: by_case[name])
    monkeypatch.setattr("refcheck.diff.judge.judge", lambda trace, pool, case, *a, **k: by_case[case])
    return [pages(n) for n in ON_PAGE]


def run_gate_html(cli, gate_dir: Path, out: Path, *extra: str) -> tuple[int, str]:
    code, _, err = cli("gate", str(gate_dir), "--workers", "1", "--html", str(out), *extra)
    return code, err


def test_the_gate_page_holds_every_case(pages, cli, gate_dir, tmp_path, monkeypatch):
    cases = stub_verdicts(monkeypatch, pages)
    out = tmp_path / "gate.html"
    code, err = run_gate_html(cli, gate_dir, out)
    assert code == 1, err  # the verdict's exit code
    html = out.read_text()
    check_cases_page(html, cases)
    assert f"wrote {out} ({out.stat().st_size:,} bytes)" in err
    assert err.index("gate: 2 cases") < err.index(f"wrote {out}")


def test_the_gate_page_reads_the_golden_trace_of_a_cached_report(pages, cli, gate_dir, tmp_path, monkeypatch):
    cases = stub_verdicts(monkeypatch, pages)
    cache = tmp_path / "cache"
    assert run_gate_html(cli, gate_dir, tmp_path / "first.html", "--cache-dir", str(cache))[0] == 1

    def no_diff(*args, **kwargs):
        raise AssertionError("the case was diffed again")

    monkeypatch.setattr("refcheck.goldens.judge.check_trace", no_diff)
    out = tmp_path / "cached.html"
    code, err = run_gate_html(cli, gate_dir, out, "--cache-dir", str(cache))
    assert code == 1, err
    check_cases_page(out.read_text(), cases)


def test_a_trace_the_gate_page_cannot_read_is_said_and_the_gate_still_judges(pages, cli, gate_dir, tmp_path,
                                                                                 monkeypatch):
    stub_verdicts(monkeypatch, pages)
    from refcheck.trace import io as trace_io

    real = trace_io.read_trace
    failing_file = GOLDENS["fail"]

    def read(path):
        if Path(path).name == failing_file:
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(trace_io, "read_trace", read)  # the page's reads; the gate's own are refcheck.goldens.judge's
    out = tmp_path / "gate.html"
    code, err = run_gate_html(cli, gate_dir, out)
    assert code == 1, err
    page = parse(out.read_text())
    ids = page.ids()
    assert "could not be read" in ids["c1-unread"].text and failing_file in ids["c1-unread"].text
    assert ids["c1-verdict"].text.strip() == "fail" and "c1-findings" in ids
    assert "c0-q0" in ids and not any(i.startswith("c1-q") for i in ids)


def test_the_diff_page_of_two_trace_files(pages, cli, tmp_path, monkeypatch):
    cases = stub_verdicts(monkeypatch, pages)
    out = tmp_path / "diff.html"
    files = [str(ROOT / "golden" / GOLDENS[n]) for n in ON_PAGE]
    code, _, err = cli("diff", "--against", files[0], "--against", files[1], "--mode", "replay", "--html", str(out))
    assert code == 1, err
    check_cases_page(out.read_text(), cases)
    assert f"wrote {out} ({out.stat().st_size:,} bytes)" in err


def test_the_diff_page_of_a_live_engine(pages, cli, tmp_path, monkeypatch):
    rendered = pages("fail")
    monkeypatch.setattr("refcheck.cli.diff._live_engine", lambda *a, **k: (rendered.report, rendered.trace))
    out = tmp_path / "live.html"
    code, _, err = cli("diff", "--engine", "fault:sibling-leak", "--drafter", "scripted", "--html", str(out))
    assert code == 1, err
    check_cases_page(out.read_text(), [rendered])
    assert "live engine fault:sibling-leak" in out.read_text()


@pytest.mark.parametrize("command", ["gate", "diff"])
def test_an_html_path_in_a_missing_directory_is_exit_2_before_any_diff(command, cli, gate_dir, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    for target in ("refcheck.goldens.verify.verify", "refcheck.goldens.judge.check_trace", "refcheck.trace.io.read_trace"):
        monkeypatch.setattr(target, no_work)
    monkeypatch.setattr("refcheck.diff.judge.judge", no_work)
    missing = str(tmp_path / "missing" / "x.html")
    args = ([str(gate_dir), "--html", missing] if command == "gate"
            else ["--against", str(gate_dir / GOLDENS["pass"]), "--html", missing])
    code, _, err = cli(command, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--html" in lines[0] and "does not exist" in lines[0], err


def test_a_gate_page_that_cannot_be_written_is_exit_2_after_the_report(pages, cli, gate_dir, tmp_path, monkeypatch):
    stub_verdicts(monkeypatch, pages)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("refcheck.atomic_file.atomic_write_bytes", full)
    out = tmp_path / "gate.html"
    code, stdout, err = cli("gate", str(gate_dir), "--workers", "1", "--html", str(out), "--json")
    assert code == 2 and not out.exists()
    assert "could not write the report page" in err and err.index("gate: 2 cases") < err.index("could not write")
    assert len(json.loads(stdout)["reports"]) == 2  # the JSON is out before the error


def test_the_page_caps_are_shared_by_its_cases(pages, monkeypatch):
    from refcheck.report import Case, render_cases
    from refcheck.report import page as page_module
    from refcheck.report.findings_list import FINDINGS_CAP

    monkeypatch.setattr(page_module, "TREE_CAP", 7)
    cases = [pages(n) for n in ON_PAGE]
    page = parse(render_cases([Case(c.report, c.trace) for c in cases], "refcheck gate", "refcheck gate --json"))
    trees = [el for el in page.elements if el.tag == "svg" and "treesvg" in el.classes]
    assert len(trees) == 7
    # the failing case is drawn first: its first divergences have their trees, the passing case the rest
    failing = [el for el in trees if any(a.attrs.get("id") == "c1" for a in el.ancestors)]
    assert len(failing) >= len(cases[1].report.first_divergence())
    rows = [el for el in page.elements if el.tag == "tr" and re.fullmatch(r"c\d+-f\d+", el.attrs.get("id", ""))]
    assert len(rows) == min(FINDINGS_CAP, sum(len(c.report.findings) for c in cases))
    assert any("shared by its 2 cases" in el.text for el in page.elements if "brief" in el.classes)


@pytest.mark.skipif(chromium() is None, reason="no chromium or chromium-browser on PATH")
def test_a_browser_follows_a_case_link_of_the_gate_page(pages, cli, gate_dir, tmp_path, monkeypatch):
    cases = stub_verdicts(monkeypatch, pages)
    out = tmp_path / "gate.html"
    assert run_gate_html(cli, gate_dir, out)[0] == 1
    screenshot(out, tmp_path / "gate.png")
    assert (tmp_path / "gate.png").stat().st_size > 10_000
    # a copy with a probe: click the failing case's index link, then record where the page went
    probe = ("<script>window.addEventListener('load',function(){document.querySelector('#cases a[href=\"#c1\"]')"
             ".click();setTimeout(function(){var p=document.createElement('pre');p.id='probe';p.textContent="
             "JSON.stringify({hash:location.hash,y:window.scrollY,top:document.getElementById('c1')"
             ".getBoundingClientRect().top});document.body.appendChild(p);},200);});</script>")
    probed = tmp_path / "probed.html"
    probed.write_text(out.read_text().replace("</body>", probe + "</body>"))
    browser = chromium()
    assert browser is not None
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--window-size=1400,2000", "--virtual-time-budget=3000", "--dump-dom", f"file://{probed}"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    seen = parse(dom)
    where = json.loads(seen.ids()["probe"].text)
    assert where["hash"] == "#c1" and where["y"] > 0 and abs(where["top"]) < 2, where
    check_cases_page(re.sub(r'<pre id="probe">.*?</pre>', "", dom, flags=re.S), cases)
    # the case the link leads to, as a browser shows it: a copy that shows only the :target case (a headless
    # screenshot of a scrolled page comes out blank, about 13 kB), opened at #c1
    only = tmp_path / "only-target.html"
    only.write_text(out.read_text().replace("</head>", "<style>section.case:not(:target),#index{display:none}</style></head>"))
    shot = tmp_path / "gate-c1.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--screenshot={shot}", "--window-size=1400,2000", f"file://{only}#c1"],
                   check=True, capture_output=True, timeout=120)
    assert shot.stat().st_size > 50_000
