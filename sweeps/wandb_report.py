"""A W&B Report for the sweep's W&B group, through the Reports API of `wandb-workspaces` (imported lazily).

Creating a report needs a W&B server and an API key; tests/test_sweeps.py exercises this module only with
that API mocked at its boundary.
"""
import os
from typing import Optional

OFFLINE_MODES = ("offline", "dryrun", "disabled")


def wandb_target(runs: list) -> Optional[dict]:
    """{project, entity, group} when the runs logged to W&B online (API key set, mode online or auto); else None."""
    if not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in OFFLINE_MODES:
        return None
    for run in runs:
        logger = run.config.get("logger", {})
        if logger.get("name") == "wandb" and logger.get("mode") in ("online", "auto") and logger.get("group"):
            return {"project": logger["project"], "entity": logger.get("entity"), "group": logger["group"]}
    return None


def create_report(target: dict, title: str, description: str, table_markdown: str, sources: list) -> str:
    """Save a report of the group's runs (loss vs tokens, val loss, per-source val loss, the table); its URL."""
    import wandb_workspaces.reports.v2 as wr

    report = wr.Report(project=target["project"], title=title[:128], description=description,
                       **({"entity": target["entity"]} if target["entity"] else {}))
    runset = wr.Runset(entity=report.entity, project=target["project"], name=target["group"],
                       filters=f"Group = '{target['group']}'")
    panels = [wr.LinePlot(title="train loss vs tokens", x="tokens_seen", y=["loss"]),
              wr.LinePlot(title="val loss", x="Step", y=["val_loss"]),
              wr.LinePlot(title="tokens/s", x="Step", y=["tokens_per_sec"])]
    if sources:
        panels.append(wr.LinePlot(title="val loss per source", x="Step", y=[f"val_loss/{s}" for s in sources]))
    report.blocks = [wr.MarkdownBlock(text=table_markdown), wr.PanelGrid(runsets=[runset], panels=panels)]
    report.save()
    return report.url
