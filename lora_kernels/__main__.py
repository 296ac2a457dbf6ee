import sys

from lora_kernels.cli import main

sys.exit(main())
