# One compile-fail test: builds the object target TARGET in the build tree BUILD_DIR, and passes
# only if the build fails and its output matches the regular expression on SOURCE's first line,
#   // expect: <CMake regular expression>
# (read at test time, so editing the expectation needs no reconfigure).
# Usage: cmake -DBUILD_DIR=... -DTARGET=... -DSOURCE=... [-DCONFIG=...] -P check.cmake
foreach(_var BUILD_DIR TARGET SOURCE)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "check.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(STRINGS "${SOURCE}" _first_line LIMIT_COUNT 1)
if(NOT _first_line MATCHES "^// expect: (.+)$")
  message(FATAL_ERROR "${SOURCE}: the first line must be `// expect: <regex>`, got: ${_first_line}")
endif()
set(_expect "${CMAKE_MATCH_1}")

set(_config_args)
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${_config_args}
                RESULT_VARIABLE _status OUTPUT_VARIABLE _out ERROR_VARIABLE _out)

if(_status EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must not: expected an error matching\n  ${_expect}")
endif()
if(NOT _out MATCHES "${_expect}")
  message(FATAL_ERROR "${SOURCE} failed to compile, but not with an error matching\n  ${_expect}\n"
                      "compiler output:\n${_out}")
endif()
message(STATUS "${SOURCE}: fails to compile as expected (${_expect})")
