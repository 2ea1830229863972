"""CPU simulator of the megakernel: executes a schedule instruction by instruction."""
from .simulator import Simulator  # noqa: F401
from .hazards import check_hazards  # noqa: F401
