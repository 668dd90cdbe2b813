"""``GET /v1/jobs/{id}/samples``: a version's rollouts as rollout kept them (issue 50).

The job is the token's tenant's or a 404 with a missing job's body (:func:`views.owned`); the
records are read from the object store (``marlaas.platform.samples``), bounded where they are
written, so an answer holds at most ``limits.MAX_SAMPLE_GROUPS`` groups of bounded text.
"""

from __future__ import annotations

import asyncio

from litestar import Request, get

from marlaas.platform.http_api import VersionSamples
from marlaas.platform.samples import read_samples, sampled_versions
from marlaas.platform.store import ObjectNotFound
from marlaas.platform.tenants import TenantRecord
from services.gateway.context import ApiError, gateway_of
from services.gateway.views import owned, version_number


def chosen_samples_version(job: str, versions: list[int], asked: int | None) -> int:
    """The version to show: ``asked``, else the newest with samples; a 404 saying which versions
    have samples when there are none or not that one."""
    if not versions:
        raise ApiError(404, f"job {job} has no samples yet: a GRPO job's first batch keeps them once it is "
                            "sampled (an sft job has none)")
    if asked is None:
        return versions[-1]
    if asked not in versions:
        raise ApiError(404, f"job {job} keeps no samples of version {asked}: it keeps those of versions "
                            f"{', '.join(map(str, versions))} (the last few, and evenly spaced older ones)")
    return asked


@get("/jobs/{job:str}/samples", summary="A version's rollouts: prompt, turns, tool calls, answer, reward, advantage",
     description="The episodes rollout kept of one version's batch, group by group: the prompt, each episode's "
                 "turns (the model's, with the tool call it wrote, and each tool's result), its answer, reward "
                 "and GRPO advantage. The newest version with samples unless ?version=V; `versions` lists every "
                 "version whose samples are kept (the last 8, evenly spaced older ones, pinned ones). Bounded: "
                 "the first 8 groups of a version, 8 episodes of each, texts cut in their middle.")
async def get_samples(request: Request, tenant: TenantRecord, job: str, version: str | None = None) -> VersionSamples:
    await owned(request, tenant, job)
    asked = None if version is None else version_number(version, "query parameter 'version'")
    store = gateway_of(request).store
    versions = await asyncio.to_thread(sampled_versions, store, job)
    shown = chosen_samples_version(job, versions, asked)
    try:
        groups = await asyncio.to_thread(read_samples, store, job, shown)
    except ObjectNotFound:  # collected between the listing and the read
        groups = []
    if not groups:
        raise ApiError(404, f"the samples of {job} version {shown} are no longer kept: GET without ?version= "
                            "for the newest")
    return VersionSamples(job=job, version=shown, policy_version=groups[0].policy_version, groups=groups,
                          batch_groups=max(g.batch_groups for g in groups), versions=versions)


SAMPLE_ROUTES = [get_samples]
