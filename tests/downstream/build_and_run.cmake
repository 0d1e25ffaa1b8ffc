# One downstream step, run by ctest (registered in downstream.cmake).
#   -DINSTALL_FROM=<build tree> -DPREFIX=<dir>        install trainkit into a fresh PREFIX
#   -DSOURCE_DIR=<project> -DBINARY_DIR=<dir> -DINIT_CACHE=<file> -DEXPECT=<regex>
#     [-DGENERATOR=<name>] [-DEXTRA_ARGS=<-D...>]
#     [-DEXPECT_TRAINKIT_DIR=<path prefix>]           configure the project in a fresh BINARY_DIR
#                                                     (settings from INIT_CACHE), build it, run
#                                                     `downstream` and match its output
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _status OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _status EQUAL 0)
    message(FATAL_ERROR "${what} failed (${_status}):\n${_out}")
  endif()
  set(step_output "${_out}" PARENT_SCOPE)
endfunction()

if(DEFINED INSTALL_FROM)
  file(REMOVE_RECURSE "${PREFIX}")
  run_step("cmake --install" "${CMAKE_COMMAND}" --install "${INSTALL_FROM}" --prefix "${PREFIX}")
  message(STATUS "installed into ${PREFIX}")
  return()
endif()

file(REMOVE_RECURSE "${BINARY_DIR}")
set(_generator_args)
if(GENERATOR)
  set(_generator_args -G "${GENERATOR}")
endif()
run_step("configure" "${CMAKE_COMMAND}" ${_generator_args} -C "${INIT_CACHE}" -S "${SOURCE_DIR}"
         -B "${BINARY_DIR}" ${EXTRA_ARGS})
if(DEFINED EXPECT_TRAINKIT_DIR)
  file(STRINGS "${BINARY_DIR}/CMakeCache.txt" _found REGEX "^trainkit_DIR:")
  string(FIND "${_found}" "${EXPECT_TRAINKIT_DIR}" _at)
  if(NOT _at GREATER 0)
    message(FATAL_ERROR "trainkit was not found under ${EXPECT_TRAINKIT_DIR}: ${_found}")
  endif()
endif()
run_step("build" "${CMAKE_COMMAND}" --build "${BINARY_DIR}")
file(GLOB _program "${BINARY_DIR}/downstream" "${BINARY_DIR}/*/downstream" "${BINARY_DIR}/downstream.exe")
if(NOT _program)
  message(FATAL_ERROR "no program `downstream` in ${BINARY_DIR}")
endif()
list(GET _program 0 _program)
run_step("running ${_program}" "${_program}")
message(STATUS "${_program}: ${step_output}")
if(NOT step_output MATCHES "${EXPECT}")
  message(FATAL_ERROR "output does not match ${EXPECT}")
endif()
