# Runs COMMAND with ARGS (a ;-list) and checks its exit status (STATUS) and that STREAM
# (stdout or stderr) matches REGEX. Used by the trainkit-config tests in CMakeLists.txt.
execute_process(COMMAND ${COMMAND} ${ARGS}
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(STREAM STREQUAL "stdout")
  set(text "${out}")
else()
  set(text "${err}")
endif()
if(NOT status STREQUAL "${STATUS}")
  message(FATAL_ERROR "expected exit status ${STATUS}, got ${status}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT text MATCHES "${REGEX}")
  message(FATAL_ERROR "${STREAM} does not match: ${REGEX}\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "exit ${status}; ${STREAM} matches ${REGEX}")
