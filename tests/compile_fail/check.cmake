# The compile-fail tests (tests/CMakeLists.txt). A case is a file whose first line is
#   // expect: <CMake regular expression>
# (read at test time, so editing the expectation needs no reconfigure); it passes only if it
# fails to compile with an error matching it. Three uses:
#
#   cmake -DBUILD_DIR=... -DTARGET=... -DSOURCE=... [-DCONFIG=...] -P check.cmake
#       builds the object target TARGET (SOURCE alone) in the build tree BUILD_DIR: passes only if
#       the build fails and its output matches SOURCE's expectation.
#   cmake -DBUILD_DIR=... -DTARGET=... -DLOG=... [-DCONFIG=...] -P check.cmake
#       builds TARGET (every case in one translation unit) and writes the output to LOG: passes
#       only if the build fails.
#   cmake -DLOG=... -DSOURCE=... -P check.cmake
#       passes only if the errors in LOG that the compiler places in SOURCE's file match its
#       expectation. An error belongs to the case whose file the diagnostics last named with a
#       line number ("<case>.cpp:3:50: required from here", or the error's own place): GCC's
#       order, which names the place before the error (Clang names it after, in notes).

# The output of `cmake --build` for TARGET, in _out; its exit status in _status.
macro(build_target)
  set(_config_args)
  if(CONFIG)
    set(_config_args --config "${CONFIG}")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${_config_args}
                  RESULT_VARIABLE _status OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
endmacro()

# SOURCE's expectation, in _expect.
macro(read_expectation)
  file(STRINGS "${SOURCE}" _first_line LIMIT_COUNT 1)
  if(NOT _first_line MATCHES "^// expect: (.+)$")
    message(FATAL_ERROR "${SOURCE}: the first line must be `// expect: <regex>`, got: ${_first_line}")
  endif()
  set(_expect "${CMAKE_MATCH_1}")
endmacro()

# The error lines of LOG that belong to the file named `owner` (its name without .cpp; "" for
# errors before any file was named), in `out`.
function(errors_of owner out)
  file(READ "${LOG}" _text)
  # One list element per line: the characters CMake's lists treat specially stand in for
  # themselves until a line is kept.
  string(REPLACE ";" "<semicolon>" _text "${_text}")
  string(REPLACE "[" "<open>" _text "${_text}")
  string(REPLACE "]" "<close>" _text "${_text}")
  string(REPLACE "\n" ";" _lines "${_text}")
  set(_owner "")
  set(_errors "")
  foreach(_line IN LISTS _lines)
    if(_line MATCHES "(^|[/ ])([A-Za-z0-9_]+)\\.cpp:[0-9]+")
      set(_owner "${CMAKE_MATCH_2}")
    endif()
    if(_owner STREQUAL owner AND _line MATCHES "error: ")
      string(APPEND _errors "${_line}\n")
    endif()
  endforeach()
  string(REPLACE "<semicolon>" ";" _errors "${_errors}")
  string(REPLACE "<open>" "[" _errors "${_errors}")
  string(REPLACE "<close>" "]" _errors "${_errors}")
  set(${out} "${_errors}" PARENT_SCOPE)
endfunction()

if(DEFINED TARGET AND DEFINED SOURCE)
  read_expectation()
  build_target()
  if(_status EQUAL 0)
    message(FATAL_ERROR "${SOURCE} compiled, but it must not: expected an error matching\n  ${_expect}")
  endif()
  if(NOT _out MATCHES "${_expect}")
    message(FATAL_ERROR "${SOURCE} failed to compile, but not with an error matching\n  ${_expect}\n"
                        "compiler output:\n${_out}")
  endif()
  message(STATUS "${SOURCE}: fails to compile as expected (${_expect})")
  return()
endif()

if(DEFINED TARGET AND DEFINED LOG)
  file(REMOVE "${LOG}")  # (a case never reads an earlier build's output)
  build_target()
  file(WRITE "${LOG}" "${_out}")
  if(_status EQUAL 0)
    message(FATAL_ERROR "${TARGET} compiled, but every compile-fail case in it must fail: none does\n${_out}")
  endif()
  # An error outside every case (in the headers, before the first case) would be no case's.
  errors_of("" _before)
  errors_of("${TARGET}" _outside)
  if(NOT _before STREQUAL "" OR NOT _outside STREQUAL "")
    message(FATAL_ERROR "${TARGET}: errors outside every case (the headers do not compile on their own):\n"
                        "${_before}${_outside}compiler output: ${LOG}")
  endif()
  message(STATUS "${TARGET} fails to compile, as its cases must; the output is in ${LOG}")
  return()
endif()

if(NOT DEFINED LOG OR NOT DEFINED SOURCE)
  message(FATAL_ERROR "check.cmake: give -DBUILD_DIR, -DTARGET and -DSOURCE; -DBUILD_DIR, -DTARGET and -DLOG; "
                      "or -DLOG and -DSOURCE")
endif()
read_expectation()
if(NOT EXISTS "${LOG}")
  message(FATAL_ERROR "no compiler output '${LOG}': the cases' build (compile_fail.build) did not run")
endif()
get_filename_component(_case "${SOURCE}" NAME_WE)
errors_of("${_case}" _errors)
if(_errors STREQUAL "")
  message(FATAL_ERROR "${SOURCE}: the compiler placed no error in it (it compiles), but it must fail with an error "
                      "matching\n  ${_expect}\ncompiler output: ${LOG}")
endif()
if(NOT _errors MATCHES "${_expect}")
  message(FATAL_ERROR "${SOURCE} failed to compile, but not with an error matching\n  ${_expect}\n"
                      "its errors:\n${_errors}compiler output: ${LOG}")
endif()
message(STATUS "${SOURCE}: fails to compile as expected (${_expect})")
