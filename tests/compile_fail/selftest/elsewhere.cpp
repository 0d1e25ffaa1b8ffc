// expect: static assertion failed: the message that belongs to elsewhere
// Never compiled: compile_fail.selftest_elsewhere reads elsewhere.log, a compiler's output in which
// this message is placed in another case's file and this file has an error of its own. Registered
// with WILL_FAIL: an expected error that belongs to another case must not pass.
int main() { return 0; }
