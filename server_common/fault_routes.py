"""``/admin/faults``: the fault-injection hook's routes (only mounted when the
cluster config says ``fault_injection: true``; see ``server_common.faults``)."""

from __future__ import annotations

from fastapi import FastAPI

from server_common.faults import FaultInjector, FaultPlan, FaultStatus


def add_fault_routes(app: FastAPI, faults: FaultInjector) -> None:
    @app.get("/admin/faults")
    async def fault_status() -> FaultStatus:
        return faults.status()

    @app.post("/admin/faults")
    async def arm_faults(plan: FaultPlan) -> FaultStatus:
        """Replace the armed plan (an empty body disarms everything)."""
        faults.arm(plan)
        return faults.status()

    @app.post("/admin/faults/release")
    async def release_faults() -> FaultStatus:
        faults.release()
        return faults.status()
