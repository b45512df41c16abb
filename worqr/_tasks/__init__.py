"""The function layer: task functions registered on a `Tasks` registry, submitted
with typed arguments and served by dispatch on the function's name. It is built on
jobs (`Worqr.submit`, `Worqr.consume`); a call is a job whose envelope names its
function and whose payload holds its arguments (docs/protocol.md, Calls)."""
