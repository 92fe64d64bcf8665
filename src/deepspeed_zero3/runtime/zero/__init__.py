# Import deepspeed before any module of this package. Our modules import from deepspeed, and
# deepspeed's own __init__ imports the overlaid deepspeed.runtime.zero.parameter_offload, i.e. our
# parameter_offload, which imports our other modules. Entered from one of our modules (say
# `import deepspeed_zero3.runtime.zero.trace` before `import deepspeed`), that cycle reached a
# half-initialised module of ours and failed with an ImportError. With deepspeed imported here
# first, the cycle always starts inside deepspeed; while deepspeed itself is importing (the usual
# path, through the overlay finder), this import returns the partly initialised module at once.
import deepspeed  # noqa: F401
