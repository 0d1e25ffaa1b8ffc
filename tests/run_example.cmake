# Runs PROGRAM in DIR, emptied first (a README or guide example: test readme.example, docs.<page>),
# so that every run starts afresh (the fit loop would otherwise resume an earlier run's checkpoints).
# Fails when the program exits nonzero. (Emptying it here keeps std::filesystem::remove_all out of
# the examples: libtorch.so exports its own std::filesystem symbols, and remove_all through them
# crashes with LibTorch 2.11; see tests/support/helpers.hpp.)
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
# ARGUMENT, where given, names the example in the program that holds them all (trainkit_doc_examples).
execute_process(COMMAND "${PROGRAM}" ${ARGUMENT} WORKING_DIRECTORY "${DIR}" RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} ${ARGUMENT} exited with ${status}")
endif()
