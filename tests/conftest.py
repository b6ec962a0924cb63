"""Shared helpers live in this folder (emulated_hosts.py): make them importable from every suite."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
