"""`python -m k3chat`: the same entry point as the `k3chat` console script."""

import sys

from k3chat.launch import main

sys.exit(main())
