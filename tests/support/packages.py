"""Python packages a test reads with: imported, or installed into this interpreter's environment
(the torch venv, .venv/, where scripts/setup installs them) when missing. A failed install fails
the test, saying why. And the two helpers every such test uses: fail() and run()."""
import importlib
import subprocess
import sys


def import_or_install(module, package):
    """`import module`, installing `package` with pip first if the import fails."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print("%s is not installed in %s: installing it" % (package, sys.prefix))
        status = subprocess.call([sys.executable, "-m", "pip", "install", "-q", package])
        if status != 0:
            print("FAIL: pip install %s failed (status %d): cannot check the files" % (package, status))
            sys.exit(1)
        return importlib.import_module(module)


def fail(message):
    """Ends the test as failed, saying why."""
    print("FAIL: " + message)
    sys.exit(1)


def run(args, expect=0):
    """Runs a program; fails the test when its exit status is not `expect`. Returns its output."""
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != expect:
        fail("%s exited %d (expected %d):\n%s%s" % (" ".join(args), p.returncode, expect, p.stdout, p.stderr))
    return p.stdout + p.stderr
