import os
import sys

# numpy references and helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
