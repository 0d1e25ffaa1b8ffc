# The unit counts a configuration asks for are the ones it gets: trainkit configured (nothing
# built) with TRAINKIT_REGISTRY_UNITS=5 and TRAINKIT_UNITY_TEST_UNITS=8 generates exactly 5
# registry units holding every precision's shard once, and 8 unity units of the tests; then
# reconfigured with 2 registry units, the 3 stale ones are gone. Run by ctest
# (downstream.unit_counts):
#   cmake -DSOURCE=<trainkit> -DWORK=<scratch> -DINIT_CACHE=<file> -DGENERATOR=<g> -P unit_counts.cmake
file(REMOVE_RECURSE "${WORK}")

function(configure registry_units)
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${WORK}" -C "${INIT_CACHE}" -G "${GENERATOR}"
                          -DTRAINKIT_REGISTRY_UNITS=${registry_units} -DTRAINKIT_UNITY_TEST_UNITS=8
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring ${SOURCE} with TRAINKIT_REGISTRY_UNITS=${registry_units} failed:\n${out}")
  endif()
endfunction()

# `expected` registry units, and the precisions of registry.hpp's list each in one shard line.
function(check_registry expected)
  file(GLOB units "${WORK}/trainkit_registry/*.cpp")
  list(LENGTH units count)
  if(NOT count EQUAL expected)
    message(FATAL_ERROR "TRAINKIT_REGISTRY_UNITS=${expected}: ${count} units generated (${units})")
  endif()
  file(READ "${SOURCE}/include/trainkit/run/registry.hpp" text)
  string(REGEX MATCH "#define TRAINKIT_REGISTRY_PRECISIONS\\(X\\)(([^\n]*\\\\\n)*[^\n]*)" _ "${text}")
  string(REGEX MATCHALL "X\\(([^()]+)\\)" entries "${CMAKE_MATCH_1}")
  set(shards "")
  foreach(unit IN LISTS units)
    file(STRINGS "${unit}" lines REGEX "^TRAINKIT_REGISTRY_SHARD\\(")
    list(APPEND shards ${lines})
  endforeach()
  foreach(entry IN LISTS entries)
    string(REGEX REPLACE "^X\\((.*)\\)$" "\\1" precision "${entry}")
    string(STRIP "${precision}" precision)
    list(FIND shards "TRAINKIT_REGISTRY_SHARD(${precision})" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "no registry unit instantiates ${precision} (shards: ${shards})")
    endif()
    list(REMOVE_AT shards ${at})
  endforeach()
  if(shards OR NOT entries)
    message(FATAL_ERROR "registry units instantiate shards the list does not have, or the list is empty: '${shards}'")
  endif()
endfunction()

configure(5)
check_registry(5)
# The tests' unity sources, by name, in the build files of any generator.
file(GLOB_RECURSE unity RELATIVE "${WORK}" "${WORK}/tests/*unity_tests_*_cxx.cxx")
list(LENGTH unity count)
if(NOT count EQUAL 8)
  message(FATAL_ERROR "TRAINKIT_UNITY_TEST_UNITS=8: ${count} unity units of the tests (${unity})")
endif()
configure(2)
check_registry(2)
message(STATUS "5 then 2 registry units and 8 test units, as asked")
