# `cmake -S . -B b && cmake --install b`, with nothing built: trainkit is header-only, so the
# package (headers, CMake files, LICENSE) installs, and the programs, which were not built, are
# skipped. Run by ctest (downstream.install_unbuilt):
#   cmake -DSOURCE=<trainkit> -DWORK=<scratch> -DINIT_CACHE=<file> -DGENERATOR=<g> -P install_unbuilt.cmake
file(REMOVE_RECURSE "${WORK}")
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${WORK}/build" -C "${INIT_CACHE}" -G "${GENERATOR}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring ${SOURCE} failed:\n${out}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${WORK}/build" --prefix "${WORK}/prefix"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install of the unbuilt tree failed:\n${out}")
endif()
foreach(file include/trainkit/trainkit.hpp include/trainkit/io/weights.hpp include/trainkit/trainer/trainer_core-inl.hpp
             share/trainkit/compiled/trainkit.cpp share/cmake/trainkit/trainkitConfig.cmake
             share/doc/trainkit/LICENSE bin/trainkit-plot)
  if(NOT EXISTS "${WORK}/prefix/${file}")
    message(FATAL_ERROR "cmake --install of the unbuilt tree did not install ${file}:\n${out}")
  endif()
endforeach()
message(STATUS "the unbuilt tree installed the header-only package into ${WORK}/prefix")
