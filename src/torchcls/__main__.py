import sys

from torchcls.cli import main

sys.exit(main())
