import os
import sys

from .run import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # A failed rank must not wait in process-group teardown for peers that are
        # stuck in a collective; torchrun stops them once this process is gone.
        os._exit(code)
    sys.exit(0)
