"""``make demo``'s own parts: the warm-start chain it submits, its summary of an sft job, its plot."""

from rich.console import Console

from marlaas.cli.demo import chain_jobs, plot_chain, summary_table
from marlaas.platform.api import JobView, follow_up, parse_submission


def view(name: str, task: str, rewards: list[float], **metrics: list[float]) -> JobView:
    return JobView(id=f"default.{name}-1", name=name, tenant="default", task=task, state="completed", reason="",
                   version=len(rewards or metrics.get("loss", [])), steps=3, target_steps=3, rewards=rewards,
                   ttfs_s=1.0, tpts_s=0.5, metrics={k.replace("_", "/", 1): v for k, v in metrics.items()})


def test_the_chain_is_the_projects_job_files_over_the_uploaded_data():
    probe, sft = chain_jobs("file-prompts", "file-demos")
    assert probe["steps"] == 1 and probe["dataset"] == "file-prompts" and probe["task"] == "agent"
    chained = parse_submission(sft)
    assert (chained.task, chained.dataset) == ("sft", "file-demos")
    rl = follow_up(chained)
    assert (rl.task, rl.dataset, rl.tools) == ("agent", "file-prompts", chained.tools)


def test_the_summary_shows_an_sft_jobs_loss_and_an_agents_calls(tmp_path):
    sft = view("tool-sft", "sft", [], loss=[1.44, 0.5, 0.02])
    rl = view("tool-rl", "agent", [0.4, 0.6, 0.8], tool_success_rate=[0.5, 0.7, 0.8])
    console = Console(width=200, record=True)
    console.print(summary_table([sft, rl]))
    text = console.export_text()
    assert "loss 1.440" in text and "loss 0.020" in text and "0.67 -> 0.67" in text
    plot = plot_chain(view("base-probe", "agent", [0.0], tool_success_rate=[0.0]), sft, rl, tmp_path / "chain.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
