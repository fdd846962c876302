"""The stageb-pool command end to end in subprocesses (no model needed): exit codes,
one-line errors without tracebacks, --gpus errors, check, diff, and that bad input never
touches an existing run directory. The exit-code mapping of run failures is tested
in-process with job.run_plan replaced."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stageb_pool.app import cli
from stageb_pool.pool import Fork, Inline, Ray, WorkerError
from stageb_pool.stageb.errors import MAX_ERROR_CHARS, InputError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
MISSION = "Rooftop antenna mount inspection"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or REPO, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int = 2, *words: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def project(tmp_path) -> Path:
    """A config in tmp_path using copies of the demo tickets and guidance; runs go to tmp_path/runs."""
    (tmp_path / "tickets.jsonl").write_bytes((DEMO / "tickets.jsonl").read_bytes())
    (tmp_path / "guidance.json").write_bytes((DEMO / "guidance.json").read_bytes())
    text = (REPO / "configs" / "demo.yaml").read_text()
    text = text.replace("demo/tickets.jsonl", "tickets.jsonl").replace("demo/guidance.json", "guidance.json")
    text = text.replace("root: ../runs", "root: runs")
    (tmp_path / "c.yaml").write_text(text)
    return tmp_path


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- arguments ----------------------------------------------------------------------------


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("stageb-pool ")


def test_no_arguments_is_exit_2():
    proc = run_cli()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,words", [
    (["run", "configs/demo.yaml"], ["--gpus"]),
    (["--gpus", "cpu", "--resume", "--overwrite", "configs/demo.yaml"], ["--overwrite", "--resume"]),
    (["--gpus", "cpu", "--log-level", "loud", "configs/demo.yaml"], ["--log-level"]),
    (["chek", "configs/demo.yaml"], ["did you mean 'check'"]),
    (["diff", "only_one"], ["RUN_B"]),
    (["--gpus", "cpu", "configs/demo.yaml", "--bogus"], ["--bogus"]),
])
def test_argument_errors_are_one_line_exit_2(args, words):
    assert_one_line_error(run_cli(*args), 2, *words)


@pytest.mark.parametrize("spec,words", [
    ("3", ["GPU 3 does not exist", "no GPU is visible"]),
    ("0-7", ["does not exist"]),
    ("zero", ["cannot read GPU list"]),
    ("cpu:0", ["cpu:N"]),
    ("2-1", ["backwards"]),
])
def test_gpus_errors(spec, words, project):
    line = assert_one_line_error(run_cli("--gpus", spec, str(project / "c.yaml")), 2, *words)
    assert "--gpus" in line


# --- config errors through the CLI ---------------------------------------------------------


def test_bad_config_key_is_located(project):
    cfg = project / "c.yaml"
    cfg.write_text(cfg.read_text() + "sed: 3\n")
    assert_one_line_error(run_cli("check", str(cfg)), 2, f"{cfg}: sed", "did you mean 'seed'")


def test_bad_yaml_names_the_line(project):
    cfg = project / "c.yaml"
    cfg.write_text("seed: 1\nrunner: [\n")
    assert_one_line_error(run_cli("--gpus", "cpu", str(cfg)), 2, f"{cfg}:", "invalid YAML")


def test_bad_set_path(project):
    assert_one_line_error(run_cli("check", str(project / "c.yaml"), "--set", "runner.chunk=3"), 2,
                          "--set", "runner.chunk_size")


def test_missing_config_file(tmp_path):
    assert_one_line_error(run_cli("--gpus", "cpu", str(tmp_path / "none.yaml")), 2, "config file not found")


# --- check ---------------------------------------------------------------------------------


def test_check_demo_prints_the_plan():
    proc = run_cli("check", "configs/demo.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    tickets = [json.loads(line) for line in (DEMO / "tickets.jsonl").read_text().splitlines()]
    n_pass = sum(t["label"] == "pass" for t in tickets)
    assert MISSION in out
    assert f"{len(tickets)} (fail {len(tickets) - n_pass}, pass {n_pass})" in out
    assert "eval pool      24 tickets" in out and "a train pool of 40 per iteration" in out
    # 40 train baseline + 2 candidates x 40 + 24 eval, K = 1
    assert "up to 144 generations" in out
    assert "embedded" in out and "generic" in out
    assert "distill        off" in out


def test_check_names_the_distillation_export():
    proc = run_cli("check", "configs/demo.yaml", "--audit", "--set", "stage_b_distillation.distill_size=5")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\ndistill +5 tickets after the audit -> ", proc.stdout) and "distill_chatml.jsonl" in proc.stdout


def test_check_audit_mode_counts_every_ticket():
    proc = run_cli("check", "configs/demo.yaml", "--audit", "--set", "runner.chunk_size=16")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\nmode +audit\n", proc.stdout) and "200 tickets in 13 chunks of 16: 200 generations" in proc.stdout


def test_check_reports_a_malformed_ticket_line(project):
    lines = (project / "tickets.jsonl").read_text().splitlines(keepends=True)
    lines[4] = '{"group_id": "x", "mission": "Rooftop antenna mount inspection", "label": "maybe", "per_image": {"image_1": "a"}}\n'
    (project / "tickets.jsonl").write_text("".join(lines))
    assert_one_line_error(run_cli("check", str(project / "c.yaml")), 2, f"{project / 'tickets.jsonl'}:5")


def test_check_prints_the_ingest_conversions(project):
    lines = (project / "tickets.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    first.update(group_id=15502, label_timestamp=20250315)
    lines[0] = json.dumps(first) + "\n"
    (project / "tickets.jsonl").write_text("".join(lines))
    proc = run_cli("check", str(project / "c.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\n  converted +group_id 1\n  ignored +label_timestamp 1\n", proc.stdout), proc.stdout


def test_check_reports_guidance_without_g0(project):
    data = json.loads((project / "guidance.json").read_text())
    del data[MISSION]["experiences"]["G0"]
    (project / "guidance.json").write_text(json.dumps(data))
    assert_one_line_error(run_cli("check", str(project / "c.yaml")), 2, "guidance.json", "G0")


def test_check_reports_an_empty_ticket_file(project):
    (project / "tickets.jsonl").write_text("")
    assert_one_line_error(run_cli("check", str(project / "c.yaml")), 2, "tickets.jsonl", "no tickets")


def test_check_reports_a_missing_model_path(project):
    assert_one_line_error(run_cli("check", str(project / "c.yaml"), "--set", "model.path=./no_model"), 2, "no_model")


def _with_huge_summary(project: Path, line: int = 2, keep: int | None = None) -> str:
    """Give the ticket on ``line`` (0-based) a 200 KB summary; keep the first ``keep`` lines.
    Returns its group_id."""
    lines = (project / "tickets.jsonl").read_text().splitlines(keepends=True)[:keep]
    record = json.loads(lines[line])
    record["per_image"]["image_1"] = "the mount bolt is loose " * 8500
    lines[line] = json.dumps(record) + "\n"
    (project / "tickets.jsonl").write_text("".join(lines))
    return record["group_id"]


def _peak_rss_mb(*args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """``stageb-pool ARGS`` run from a small Python process that reports its child's peak RSS
    and CPU seconds (``RUSAGE_CHILDREN``: only that one child). CPU time, not wall time: the
    bound must hold on a loaded CI machine too."""
    code = ("import json, resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(json.dumps([p.returncode, p.stdout, p.stderr, u.ru_maxrss / 1024, u.ru_utime + u.ru_stime]))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "stageb_pool.app.cli", *args],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=True)
    rc, stdout, stderr, rss_mb, cpu_s = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, rc, stdout, stderr), rss_mb, cpu_s


@pytest.mark.parametrize("on_bad_line", ["error", "skip"])
def test_check_on_a_50_mb_ticket_line_is_fast_and_small(project, on_bad_line):
    """Issue 21: one 50 MB line took 70 s and 9.8 GB in check. The line limit reads past it."""
    lines = (project / "tickets.jsonl").read_text().splitlines(keepends=True)
    record = json.loads(lines[2])
    record["per_image"]["image_1"] = "the mount bolt is loose " * (50_000_000 // 24)
    with open(project / "tickets.jsonl", "w") as f:
        f.writelines(lines[:2])
        f.write(json.dumps(record) + "\n")
        f.writelines(lines[3:])
    proc, rss_mb, cpu_s = _peak_rss_mb("check", str(project / "c.yaml"), "--set", "model.path=tiny",
                                        "--set", f"ingest.on_bad_line={on_bad_line}")
    if on_bad_line == "error":
        assert_one_line_error(proc, 2, f"{project / 'tickets.jsonl'}:3", "over ingest.max_line_bytes (1048576)")
    else:
        assert proc.returncode == 0, proc.stderr
    assert cpu_s < 30 and rss_mb < 2048, (cpu_s, rss_mb)


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("caps", ["4096", "null"])
def test_a_model_without_a_chat_template_is_refused_before_any_worker_loads_it(project, command, caps):
    """Issue 21: a base model (no chat template) was an internal error of the prompt measure
    in check, and a worker's start-up failure in a run; without prompt caps neither looked."""
    from stageb_pool.engine import tiny

    folder = project / "base-model"
    tok = tiny.build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    sets = [f"model.path={folder}"] + [f"rule_search.{s}.max_prompt_tokens={caps}" for s in ("train_sampler", "eval_sampler")]
    args = [command, str(project / "c.yaml"), *[a for s in sets for a in ("--set", s)]]
    line = assert_one_line_error(run_cli(*args, *(["--gpus", "cpu:1"] if command == "run" else [])), 2)
    assert line == f"stageb-pool: error: {folder}: the tokenizer has no chat template (a base model, not an instruct/chat model?)"
    assert not list(project.glob("runs/*/*/rollouts*"))  # no worker judged anything


def test_a_deleted_working_directory_with_a_relative_config_is_a_located_error(project):
    gone = project / "gone"
    gone.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m stageb_pool.app.cli check c.yaml',
                           "sh", str(gone), sys.executable], capture_output=True, text=True, env=env, timeout=120)
    line = assert_one_line_error(proc, 2, "c.yaml: ", "the current directory no longer exists")
    assert line.startswith("stageb-pool: error: c.yaml: cannot resolve the config's relative path")


def test_check_names_the_ticket_whose_prompt_is_over_the_cap(project):
    group = _with_huge_summary(project)
    proc = run_cli("check", str(project / "c.yaml"), "--set", "model.path=tiny")
    assert proc.returncode == 0, proc.stderr
    over = [line for line in proc.stdout.splitlines() if "tickets over, dropped by the run" in line]
    assert len(over) == 1 and group in over[0] and "1 of " in over[0], proc.stdout
    assert "max_prompt_tokens" in over[0] and "4096" in over[0]


def test_check_refuses_guidance_that_leaves_every_prompt_over_the_cap(project):
    data = json.loads((project / "guidance.json").read_text())
    rules = data[MISSION]["experiences"]
    rules.update({f"G{i}": f"Rule {i}: the mounting bolt number {i} must be tight and sealed. " * 4
                  for i in range(2, 3002)})
    (project / "guidance.json").write_text(json.dumps(data))
    line = assert_one_line_error(run_cli("check", str(project / "c.yaml"), "--set", "model.path=tiny",
                                         "--set", "rule_search.train_sampler.max_prompt_tokens=2000"), 2)
    assert line.startswith("stageb-pool: error: rule_search.train_sampler.max_prompt_tokens: "), line
    assert "every one of the 176 train tickets would be dropped" in line
    assert "a prompt without its ticket takes" in line and "guidance.json" in line and "3003 rules" in line and "largest G" in line
    assert len(line) <= MAX_ERROR_CHARS + 100


@pytest.mark.parametrize("mode", [[], ["--audit"]])
def test_run_refuses_the_guidance_check_refuses_before_any_rollout(project, mode):
    """Issue 21: run used to drop every ticket for minutes and exit 0 with acc 0.000 (n=0)."""
    data = json.loads((project / "guidance.json").read_text())
    data[MISSION]["experiences"].update({f"G{i}": f"Rule {i}: the mounting bolt number {i} must be tight. " * 4
                                         for i in range(2, 3002)})
    (project / "guidance.json").write_text(json.dumps(data))
    args = [str(project / "c.yaml"), *mode, "--set", "model.path=tiny",
            "--set", "rule_search.train_sampler.max_prompt_tokens=2000"]
    checked = assert_one_line_error(run_cli("check", *args), 2)
    ran = assert_one_line_error(run_cli("run", "--gpus", "cpu:2", *args), 2)
    assert ran == checked and "rule_search.train_sampler.max_prompt_tokens" in ran
    assert not (project / "runs").exists()  # refused before the run directory or any worker
    # The simulated engine's workers measure prompts with their token counter, and so does
    # the run's check for it (no chat template rendered): the same refusal, its own count.
    simulated = assert_one_line_error(run_cli("run", "--gpus", "cpu:2", *args, "--set", "model.engine=simulated"), 2)
    assert simulated.startswith("stageb-pool: error: rule_search.train_sampler.max_prompt_tokens: "), simulated
    assert "would be dropped" in simulated and "a prompt without its ticket takes" in simulated
    assert not (project / "runs").exists()


# The proposer's prompt and its cap (issue 32): refused like a guidance over a sampler's cap.
SMALL_SEARCH = ["--set", "model.path=tiny", "--set", "runner.epochs=1", "--set", "headroom.enabled=false",
                "--set", "rule_search.train_pool_size=8", "--set", "rule_search.eval_pool_size=0",
                "--set", "rule_search.num_candidate_rules=1"]


def proposer_prompt_tokens(*args: str) -> int:
    """The proposer prompt's tokens with its shortest example, as check measures them."""
    proc = run_cli("check", *args)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("proposer ")]
    assert "(rule_search.proposer_max_prompt_tokens)" in line, line
    return int(re.search(r"prompt of (\d+) tokens with one example \(the shortest, ticket ROOF-DEMO-", line).group(1))


@pytest.mark.parametrize("why", ["cap", "system prompt"])
def test_check_and_run_refuse_a_proposer_prompt_over_its_cap_with_one_example(project, why):
    """A 375 KB proposer prompt passed check and run (exit 0), and every proposer call of the
    search came back unusable; so did a cap one token short of the smallest one-example prompt."""
    args = [str(project / "c.yaml"), *SMALL_SEARCH]
    if why == "cap":
        args += ["--set", f"rule_search.proposer_max_prompt_tokens={proposer_prompt_tokens(*args) - 1}"]
    else:
        (project / "proposer.txt").write_text("Propose rules for the mount inspection. " * 9000)  # 369 KB
        args += ["--set", f"rule_search.proposer_prompt_path={project / 'proposer.txt'}"]
    checked = assert_one_line_error(run_cli("check", *args), 2)
    assert checked.startswith("stageb-pool: error: rule_search.proposer_max_prompt_tokens: the proposer's prompt is "
                              "over this cap of "), checked
    assert "even with one example" in checked and "no proposer call of the search could be made" in checked
    assert ("proposer.txt" in checked and "guidance.json: 3 rules" in checked
            and (why == "cap" or str(project / "proposer.txt") in checked))
    assert len(checked) <= MAX_ERROR_CHARS + 100
    ran = assert_one_line_error(run_cli("run", "--gpus", "cpu:1", *args), 2)
    assert ran == checked
    assert not (project / "runs").exists()  # refused before the run directory or any worker
    audit = run_cli("check", *args, "--audit")  # an audit calls no proposer
    assert audit.returncode == 0 and "\nproposer " not in audit.stdout, audit.stderr


def test_an_unusable_proposer_call_is_a_warning_with_its_reason(project):
    """A cap the shortest example fits passes check, but the search's own example does not fit:
    the call is unusable, which was said only at INFO and in reflection_cache."""
    args = [str(project / "c.yaml"), *SMALL_SEARCH]
    cap = proposer_prompt_tokens(*args)
    proc = run_cli("--gpus", "cpu:1", *args, "--set", f"rule_search.proposer_max_prompt_tokens={cap}")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert warned == [warned[0]] and warned[0].endswith(
        "WARNING iteration 1: the proposer answer is unusable (prompt over proposer_max_prompt_tokens even with one "
        "example); no proposer candidates"), proc.stderr


def test_check_lines_stay_short_with_ten_thousand_rules_and_a_huge_summary(project):
    data = json.loads((project / "guidance.json").read_text())
    data[MISSION]["experiences"].update({f"G{i}": f"rule {i}" for i in range(2, 10_002)})
    (project / "guidance.json").write_text(json.dumps(data))
    _with_huge_summary(project)
    proc = run_cli("check", str(project / "c.yaml"), "--set", "model.path=tiny",
                   "--set", "rule_search.train_sampler.max_prompt_tokens=null",
                   "--set", "rule_search.eval_sampler.max_prompt_tokens=null",
                   "--set", "rule_search.proposer_max_prompt_tokens=1000000")  # 10,003 rules fit the proposer
    assert proc.returncode == 0, proc.stderr
    assert "10003 rules" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) < 2100


def test_run_logs_the_dropped_ticket(project):
    group = _with_huge_summary(project, line=2, keep=6)
    proc = run_cli("--gpus", "cpu", "--debug", "--audit", str(project / "c.yaml"), "--set", "model.path=tiny")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "WARNING" in line and "dropped, never judged" in line]
    assert len(warned) == 1 and group in warned[0] and "1 ticket(s)" in warned[0], proc.stderr


# --- bad input never damages an existing run directory -------------------------------------


def test_bad_input_leaves_an_existing_run_directory_untouched(project):
    run_dir = project / "runs" / MISSION / "demo"
    (run_dir / "snapshots").mkdir(parents=True)
    (run_dir / "guidance.json").write_text('{"old": true}\n')
    (run_dir / "summary.json").write_text('{"iterations": 3}\n')
    (run_dir / "snapshots" / "guidance-step0001.json").write_text("{}\n")
    before = snapshot(project / "runs")
    cfg = str(project / "c.yaml")

    bad_tickets = project / "bad.jsonl"
    bad_tickets.write_text('{"group_id": "g1", "mission": "M", "label": "pass"}\n')
    attempts = [
        (["--gpus", "cpu", cfg, "--set", "runner.chunk_size=0"], "runner.chunk_size"),
        (["--gpus", "cpu", cfg, "--overwrite", "--set", f"stage_a_paths={bad_tickets}"], "bad.jsonl:1"),
        (["--gpus", "cpu", cfg, "--overwrite", "--set", "guidance.path=nope.json"], "guidance.path"),
        (["--gpus", "7", cfg, "--overwrite"], "--gpus"),
        (["--gpus", "cpu", cfg], "demo"),  # exists: neither --resume nor --overwrite
    ]
    for args, words in attempts:
        assert_one_line_error(run_cli(*args), 2, words)
        assert snapshot(project / "runs") == before, args


# --- diff ----------------------------------------------------------------------------------


def test_diff_identical_and_different(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, ts, acc in ((a, 1.0, 0.5), (b, 2.0, 0.5)):
        root.mkdir()
        (root / "summary.json").write_text(json.dumps({"acc": acc, "timing": {"total_s": ts}}))
        (root / "rows.jsonl").write_text(json.dumps({"timestamp": ts, "k": 1}) + "\n")
    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 0 and "identical" in proc.stdout

    (b / "summary.json").write_text(json.dumps({"acc": 0.75, "timing": {"total_s": 3.0}}))
    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 1
    assert "summary.json acc" in proc.stdout and "A: 0.5" in proc.stdout and "B: 0.75" in proc.stdout


def test_diff_of_a_missing_directory_is_exit_2(tmp_path):
    assert_one_line_error(run_cli("diff", str(tmp_path), str(tmp_path / "nope")), 2, "no such directory")


# --- run: exit codes (run_plan replaced; the real runs are the end-to-end tests) -----------


@pytest.fixture
def fake_job(monkeypatch):
    """``job.run_plan`` replaced: each call records the plan's config and devices and the run's
    options (with the plan's mode, config file and backend among them). The plan's prompt
    check is left out too: it loads the model's tokenizer in a forked helper (seconds a call),
    and has tests of its own (test_a_model_without_a_chat_template_is_refused_...)."""
    import stageb_pool.app.job as job
    import stageb_pool.app.plan as plan

    monkeypatch.setattr(plan, "refuse_unusable_prompts", lambda config, inputs: None)
    calls = []

    def install(behaviour):
        def fake_run_plan(plan, **kwargs):
            calls.append((plan.config, plan.devices, dict(kwargs, audit=plan.config.mode == "audit",
                                                          config_path=plan.config_path,
                                                          backend=plan.backend)))
            return behaviour()
        monkeypatch.setattr(job, "run_plan", fake_run_plan)
        return calls
    return install


def test_run_passes_flags_to_the_job(fake_job, project):
    calls = fake_job(lambda: 0)
    code = cli.main(["--gpus", "cpu:2", str(project / "c.yaml"), "--audit", "--resume", "--wait",
                     "--set", "runner.epochs=1"])
    assert code == 0
    [(config, devices, kwargs)] = calls
    assert config.runner.epochs == 1 and [d.name for d in devices] == ["cpu:0", "cpu:1"]
    assert kwargs == {"audit": True, "resume": True, "overwrite": False, "backend": Fork(),
                      "config_path": str(project / "c.yaml"), "wait": math.inf}
    assert cli.main(["--gpus", "cpu:2", str(project / "c.yaml"), "--wait", "2.5"]) == 0
    assert cli.main(["--gpus", "cpu:2", str(project / "c.yaml")]) == 0
    assert [kw["wait"] for _, _, kw in calls[1:]] == [2.5, False]


def test_ray_takes_a_gpu_count_and_passes_the_address(fake_job, project, capsys):
    calls = fake_job(lambda: 0)
    assert cli.main(["--gpus", "32", "--ray", "auto", str(project / "c.yaml"), "--set", "pool.start_timeout=90"]) == 0
    [(config, devices, kwargs)] = calls
    assert [d.name for d in devices] == [f"cuda:{r}" for r in range(32)]
    assert kwargs["backend"] == Ray("auto", placement_timeout=90, connect_timeout=config.pool.connect_timeout)
    assert cli.main(["--gpus", "0-7", "--ray", "auto", str(project / "c.yaml")]) == 2  # Ray picks the GPUs
    assert "--gpus: '0-7': with Ray, the GPU spec is a count of GPUs" in capsys.readouterr().err
    assert cli.main(["--gpus", "cpu", "--ray", "auto", "--debug", str(project / "c.yaml")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_run_word_is_optional(fake_job, project):
    calls = fake_job(lambda: 0)
    assert cli.main(["run", "--gpus", "cpu:2", "--debug", str(project / "c.yaml")]) == 0
    assert calls[-1][2]["backend"] == Inline() and [d.name for d in calls[-1][1]] == ["cpu:0"]  # one worker


def test_worker_error_is_exit_1_with_one_line(fake_job, project, capsys):
    def fail():
        raise WorkerError("ValueError: boom", rank=1, device="cuda:1", method="rollout", index=3,
                          remote_traceback="Traceback (most recent call last):\n  ...\nValueError: boom")
    fake_job(fail)
    assert cli.main(["--gpus", "cpu", str(project / "c.yaml")]) == 1
    err = capsys.readouterr().err
    assert "run failed: worker 1 (cuda:1) in rollout() on item 3: ValueError: boom" in err
    assert "Traceback" not in err

    assert cli.main(["--gpus", "cpu", str(project / "c.yaml"), "--log-level", "debug"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_interrupt_is_exit_130(fake_job, project, capsys):
    def interrupt():
        raise KeyboardInterrupt
    fake_job(interrupt)
    assert cli.main(["--gpus", "cpu", str(project / "c.yaml")]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_input_error_from_the_job_is_exit_2(fake_job, project, capsys):
    def bad():
        raise InputError("duplicate ticket key 'a::pass'", "t.jsonl:9")
    fake_job(bad)
    assert cli.main(["--gpus", "cpu", str(project / "c.yaml")]) == 2
    assert capsys.readouterr().err.strip() == "stageb-pool: error: t.jsonl:9: duplicate ticket key 'a::pass'"


def test_job_exit_code_is_returned(fake_job, project):
    fake_job(lambda: 1)
    assert cli.main(["--gpus", "cpu", str(project / "c.yaml")]) == 1


def test_parent_side_cli_does_not_import_torch():
    code = "import sys; from stageb_pool.app import cli; cli.build_parser(); import stageb_pool.app.config, stageb_pool.app.diff; " \
           "print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- upstream's launcher flags --------------------------------------------------------------


def test_upstream_launcher_flags_work(fake_job, project):
    calls = fake_job(lambda: 0)
    cfg = str(project / "c.yaml")
    assert cli.main(["--config", cfg, "--gpus", "cpu", "--jump-reflection", "--log-level", "logging",
                     "--step", "all"]) == 0
    assert calls[-1][2]["audit"] is True and calls[-1][2]["backend"] == Fork()
    assert cli.logging.getLogger().level == cli.logging.INFO  # upstream's "logging" is info
    assert cli.main(["check", "--config", cfg]) == 0


def test_upstream_debug_flag_is_not_the_log_level(fake_job, project, capsys):
    # ours runs one worker inline; upstream's only raised the log level: the help says so
    # (a log line would break the one-line error of a failed --debug run)
    calls = fake_job(lambda: 0)
    assert cli.main(["--gpus", "cpu", str(project / "c.yaml"), "--debug"]) == 0
    assert calls[-1][2]["backend"] == Inline() and capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "upstream's --debug, the log level alone, is --log-" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("args,words", [
    (["--gpus", "cpu", "c.yaml", "--config", "c.yaml"], ["once"]),
    (["run", "--gpus", "cpu"], ["CONFIG file is needed"]),
    (["--gpus", "cpu", "c.yaml", "--step", "reflect"], ["--step"]),
    (["import-config"], ["CONFIG file is needed"]),
])
def test_config_flag_errors(args, words, project):
    assert_one_line_error(run_cli(*args, cwd=project), 2, *words)


def test_upstream_config_through_the_cli(tmp_path):
    """The smoke config of upstream, from its repository root (the current directory) and from
    elsewhere with --upstream-root; check prints the plan of the translated config."""
    import shutil

    root = tmp_path / "qwen3-vl"
    shutil.copytree(REPO / "tests" / "data" / "upstream", root)
    proc = run_cli("check", "configs/smoke/stage_b_tiny.yaml", "--set", "model.path=tiny", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "upstream Stage-B config, translated" in proc.stderr and "bbu_rru (language zh, domain bbu)" in proc.stdout
    proc = run_cli("check", str(root / "configs/smoke/stage_b_tiny.yaml"), "--set", "model.path=tiny", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    info, error = proc.stderr.strip().splitlines()  # the translation names the directory it used
    assert f"relative paths from {tmp_path})" in info
    assert "stage_a_paths[0]: file not found" in error and str(tmp_path / "output_post") in error
    proc = run_cli("check", str(root / "configs/smoke/stage_b_tiny.yaml"), "--upstream-root", str(root),
                   "--set", "model.path=tiny", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


# --- GPU groups (issue 25): --gpus-per-worker, with a faked 4-GPU listing -------------------------


@pytest.fixture
def four_gpus(monkeypatch):
    """A machine that lists 4 GPUs (count_gpus reads the mask; nothing touches CUDA), whose
    nvidia-smi reports 1000 bytes on each."""
    from stageb_pool.pool import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: {i: 1000 for i in range(4)})


def test_run_takes_gpus_per_worker_into_the_devices_and_the_config(fake_job, project, four_gpus):
    calls = fake_job(lambda: 0)
    cfg = str(project / "c.yaml")
    assert cli.main(["--gpus", "0-3", "--gpus-per-worker", "2", cfg]) == 0
    assert cli.main(["--gpus", "0-3", cfg, "--set", "model.gpus_per_worker=4"]) == 0
    assert cli.main(["--gpus", "0-3", "--gpus-per-worker", "1", cfg]) == 0
    assert [([d.gpus for d in devices], config.model.gpus_per_worker) for config, devices, _ in calls] == [
        ([(0, 1), (2, 3)], 2), ([(0, 1, 2, 3)], 4), ([(0,), (1,), (2,), (3,)], 1)]
    assert cli.main(["--gpus", "8", "--ray", "auto", "--gpus-per-worker", "4", cfg]) == 0
    assert [d.gpus for d in calls[-1][1]] == [(0, 1, 2, 3), (4, 5, 6, 7)] and calls[-1][0].model.gpus_per_worker == 4


@pytest.mark.parametrize("args, where, words", [
    (["--gpus", "0-2", "--gpus-per-worker", "2"], "--gpus-per-worker", "--gpus '0-2' names 3 GPUs, not a multiple of 2"),
    (["--gpus", "cpu:2", "--gpus-per-worker", "2"], "--gpus-per-worker", "applies to GPU workers only"),
    (["--gpus", "0-1", "--set", "model.gpus_per_worker=3"], "c.yaml: model.gpus_per_worker", "not a multiple of 3"),
    (["--gpus", "6", "--ray", "auto", "--gpus-per-worker", "4"], "--gpus-per-worker", "6 GPUs, not a multiple of 4"),
    (["--gpus", "0-3", "--gpus-per-worker", "0"], "stageb-pool {command}", "must be from 1 to 16, got 0"),
    (["--gpus", "0-3", "--gpus-per-worker", "two"], "stageb-pool {command}", "invalid int value: 'two'"),
    (["--gpus", "0-3", "--set", "model.gpus_per_worker=17"], "model.gpus_per_worker", "<= 16"),
])
def test_group_sizes_that_do_not_fit_are_located_errors(fake_job, project, four_gpus, capsys, args, where, words):
    fake_job(lambda: 0)
    for command in (["run"], ["check"]):
        assert cli.main([*command, str(project / "c.yaml"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and where.format(command=command[0]) in err and words in err, err


def test_a_bad_config_is_reported_before_a_bad_gpus_per_worker(fake_job, project, four_gpus, capsys):
    """The plan reads the config before it takes the device options, as it always did: with both
    wrong, the config's error is the one line."""
    for command in ("run", "check"):
        assert cli.main([command, str(project / "c.yaml"), "--gpus", "0-3", "--gpus-per-worker", "0",
                         "--set", "seed=x"]) == 2
        assert "c.yaml: seed: expected int" in capsys.readouterr().err


def test_check_prints_the_worker_layout(project, four_gpus, capsys):
    cfg = str(project / "c.yaml")
    unmeasured = ["--set", "rule_search.train_sampler.max_prompt_tokens=null",  # no tokenizer: fast
                  "--set", "rule_search.eval_sampler.max_prompt_tokens=null"]
    assert cli.main(["check", cfg, "--gpus", "0-3", "--gpus-per-worker", "2", "--set", "model.path=tiny",
                     *unmeasured]) == 0
    out = capsys.readouterr().out
    assert "workers        2 workers of 2 GPUs each" in out
    assert "  w0           cuda:0,1 (GPUs 0, 1)" in out and "  w1           cuda:2,3 (GPUs 2, 3)" in out
    assert "memory         the tiny test model (a few MB): no estimate needed" in out


def test_check_shows_the_gpus_a_mask_gives_the_workers(project, monkeypatch, capsys):
    """Under a scheduler's CUDA_VISIBLE_DEVICES=4,5,6,7, --gpus 0-3 are the machine's GPUs 4-7:
    check says so (the workers' own masks are 4,5 and 6,7: test_devices), and a request outside
    the mask names it."""
    from stageb_pool.pool import devices

    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = str(project / "c.yaml")
    fast = ["--set", "model.path=tiny", "--set", "rule_search.train_sampler.max_prompt_tokens=null",
            "--set", "rule_search.eval_sampler.max_prompt_tokens=null"]
    assert cli.main(["check", cfg, "--gpus", "0-3", "--gpus-per-worker", "2", *fast]) == 0
    out = capsys.readouterr().out
    assert "  w0           GPUs 4, 5 (visible as 0, 1)\n  w1           GPUs 6, 7 (visible as 2, 3)\n" \
           "  mask         CUDA_VISIBLE_DEVICES='4,5,6,7': --gpus numbers the GPUs it makes visible from 0\n" in out, out
    assert cli.main(["check", cfg, "--gpus", "2", *fast]) == 0
    assert "  w0           GPU 6 (visible as 2)\n" in capsys.readouterr().out
    assert cli.main(["check", cfg, "--gpus", "4-7", "--gpus-per-worker", "2", *fast]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("stageb-pool: error: --gpus: GPU 4-7 does not exist: CUDA_VISIBLE_DEVICES='4,5,6,7' makes 4 GPUs "
                   "visible, which --gpus numbers 0-3 (GPUs 4, 5, 6, 7)"), err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,-1,5")
    assert cli.main(["check", cfg, "--gpus", "0", *fast]) == 0
    assert "  w0           GPU 4 (visible as 0)\n  mask         CUDA_VISIBLE_DEVICES='4,-1,5' (CUDA stops at its " \
           "invalid entry '-1'): --gpus numbers" in capsys.readouterr().out


def write_checkpoint(folder: Path, shape=(10, 100)) -> Path:
    """A checkpoint directory whose one safetensors file declares a bfloat16 tensor of ``shape``."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    size = 2 * shape[0] * shape[1]
    header = json.dumps({"w": {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, size]},
                         "__metadata__": {"format": "pt"}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(size))
    return folder


def write_gguf(path: Path, dims=(100, 10)) -> Path:
    """A GGUF (version 3) with one string and one array of metadata and one tensor of ``dims``."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    kvs = (text("general.name") + struct.pack("<I", 8) + text("tiny")
           + text("tokens") + struct.pack("<IIQ", 9, 8, 2) + text("a") + text("bc"))
    tensor = text("w") + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", 0, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + kvs + tensor)
    return path


def test_the_memory_budget_reads_headers_only_and_warns_when_a_group_is_too_small(tmp_path, four_gpus):
    from stageb_pool.app.config import load_config
    from stageb_pool.app.describe import memory_lines
    from stageb_pool.app.memory_budget import weight_bytes
    from stageb_pool.engine.models import check_model_path
    from stageb_pool.pool.devices import parse_gpus

    ckpt = write_checkpoint(tmp_path / "ckpt")
    assert weight_bytes(ckpt, "bfloat16") == 2000 and weight_bytes(ckpt, "float32") == 4000
    assert weight_bytes(write_gguf(tmp_path / "m.gguf"), "bfloat16") == 2000  # dequantised to the dtype
    cfg = load_config(REPO / "configs" / "demo.yaml")
    model = check_model_path(str(ckpt))
    pairs = memory_lines(cfg, model, parse_gpus("0-3", gpus_per_worker=2))  # 2000 B on 2 x 1000 B
    assert pairs[0] == ("memory", "weights ~0.0 GiB per worker; a group of 2 GPUs has 0.0 GiB")
    assert pairs[1][0] == "  WARNING" and "will not fit one group: it needs 100% of its GPU memory" in pairs[1][1]
    [(_, line)] = memory_lines(cfg, model, parse_gpus("0-3", gpus_per_worker=4))
    assert line.endswith("(fits, 50%)")
    assert memory_lines(cfg, model, parse_gpus("cpu:2")) == []  # CPU workers: no GPU memory to compare


def test_the_gguf_tensor_table_reader_counts_what_the_gguf_package_counts():
    """The memory budget reads the GGUF tensor table by hand (fast); on the embedded model it
    must agree with the gguf package's own reader."""
    import gguf

    from stageb_pool.app.memory_budget import gguf_parameters
    from stageb_pool.engine.models import embedded_gguf_path

    path = embedded_gguf_path()
    assert gguf_parameters(path) == sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors) == 134_515_008
