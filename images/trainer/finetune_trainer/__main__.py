from .run import main
from .teardown import exit_process

if __name__ == "__main__":
    # Not sys.exit: see teardown.py for why a process with live process-group threads
    # must not finalize the interpreter.
    exit_process(main())
