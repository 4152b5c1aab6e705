"""The GPU layer: NVML probe, thermal health gate, arbiter with leases, device ledger."""

from __future__ import annotations

from gezel_trio.gpu.arbiter import (
    ArbiterStatistics,
    GpuArbiter,
    Lease,
    LeaseBook,
    Policy,
    PolicySetting,
    resolve_policy,
)
from gezel_trio.gpu.health import (
    DeviceSafetyPolicy,
    HealthGate,
    HealthGateStatistics,
    MemoryPressure,
    ThermalLatch,
    memory_pressure_from,
)
from gezel_trio.gpu.ledger import (
    CPU_DEVICE,
    DeviceLedger,
    LedgerSnapshot,
    ProcessIdentity,
    Reservation,
    default_capacities,
    gpu_device_id,
    open_ledger,
)
from gezel_trio.gpu.probe import DeviceHealth, GpuReading, NvmlProbe, Probe, StaticProbe

__all__ = [
    "CPU_DEVICE",
    "ArbiterStatistics",
    "DeviceHealth",
    "DeviceLedger",
    "DeviceSafetyPolicy",
    "GpuArbiter",
    "GpuReading",
    "HealthGate",
    "HealthGateStatistics",
    "Lease",
    "LeaseBook",
    "LedgerSnapshot",
    "MemoryPressure",
    "NvmlProbe",
    "Policy",
    "PolicySetting",
    "Probe",
    "ProcessIdentity",
    "Reservation",
    "StaticProbe",
    "ThermalLatch",
    "default_capacities",
    "gpu_device_id",
    "memory_pressure_from",
    "open_ledger",
    "resolve_policy",
]
