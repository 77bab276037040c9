import sys

from dsec_kernel.cli import main

sys.exit(main())
