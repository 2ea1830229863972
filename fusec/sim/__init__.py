"""CPU simulator of the megakernel: executes a schedule instruction by instruction."""
from fusec.sim.simulator import Simulator  # noqa: F401
from fusec.sim.hazards import check_hazards  # noqa: F401
