"""The commands that act on jobs: ``submit`` (a job file and flags merged), ``cancel``, ``delete``
and ``pull`` (a version's adapter downloaded).

Like the view commands, they go through the HTTP API with the SDK's client (:func:`job_client`:
``MARLAAS_URL`` / ``MARLAAS_TOKEN``, else the stack under the home dir)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from marlaas.cli.output import print_json


def submission_from_args(args) -> dict:
    """Merge a TOML job file with flags (flags win); ``--set grpo.learning_rate=1e-3`` style too."""
    from marlaas.platform.http_api import PATH_FIELDS, is_file_id
    from marlaas.sdk.http import BadRequest, read_job_file

    job: dict = {}
    if args.file:
        try:
            job = read_job_file(args.file)  # its data paths made absolute, relative to the file
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
    for key in ("name", "task", "steps", "seed", "dataset", "corpus", "reward"):
        value = getattr(args, key)
        if value is not None:
            job[key] = value
    if args.tool:
        job["tools"] = list(args.tool)
    for assignment in args.set or []:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise ValueError(f"--set {assignment!r}: use SECTION.FIELD=VALUE, e.g. grpo.group_size=8")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = job
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    missing = [k for k in ("task", "steps") if k not in job]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)}: give a job file or --task NAME --steps N")
    if getattr(args, "then", None):  # the follow-up, started from this job's last version when it completes
        try:
            job["then"] = read_job_file(args.then)
        except BadRequest as exc:
            raise ValueError(f"--then: {exc}") from None
    job.setdefault("name", job["task"])
    for key in PATH_FIELDS:  # local files, uploaded at submit: a job file's paths are relative to
        if isinstance(job.get(key), str) and not is_file_id(job[key]):  # it, flags' and --set's to here
            job[key] = str(Path(job[key]).expanduser().resolve())
    return job


def job_client(config):
    """The HTTP SDK's client: ``MARLAAS_URL`` / ``MARLAAS_TOKEN``, else the stack under the home dir."""
    from marlaas.sdk import Client

    return Client.from_env(home=config.home_dir, on_wait=lambda message: print(message, file=sys.stderr))


def cmd_submit(args, config) -> int:
    job = submission_from_args(args)
    with job_client(config) as client:
        job_id = client.submit(job)
    if args.json:
        print_json({"id": job_id})
    else:
        print(job_id)
    return 0


def cmd_cancel(args, config) -> int:
    with job_client(config) as client:
        state = client.cancel(args.job)
    if args.json:
        print_json({"id": args.job, "state": state})
    else:
        print(f"{args.job} {state}")
    return 0


def cmd_delete(args, config) -> int:
    with job_client(config) as client:
        objects = client.delete(args.job)
    if args.json:
        print_json({"id": args.job, "deleted": True, "deleted_objects": objects})
    else:
        print(f"{args.job} deleted ({objects} stored objects removed)")
    return 0


def cmd_pull(args, config) -> int:
    with job_client(config) as client:
        version = args.version
        if args.job.startswith("tinker://"):  # a Tinker checkpoint (docs/tinker.md)
            path = client.download(args.job, args.out)
            if args.json:
                print_json({"id": args.job, "path": str(path)})
            else:
                print(f"{args.job} -> {path} (a PEFT adapter directory)")
            return 0
        if version is None:
            versions = client.versions(args.job)
            if not versions:
                raise ValueError(f"job {args.job} has no committed version yet: pull it once it runs")
            version = versions[-1].version
        path = client.download(args.job, args.out, version)
    if args.json:
        print_json({"id": args.job, "version": version, "path": str(path)})
    else:
        print(f"{args.job} version {version} -> {path} (a PEFT adapter directory)")
    return 0
