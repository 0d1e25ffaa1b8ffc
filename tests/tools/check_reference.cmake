# Fails when the committed configuration reference (REFERENCE, docs/config-reference.md) is not
# what `trainkit-config reference` (TOOL) prints now, and says how to regenerate it. Test
# docs.config_reference (tools/CMakeLists.txt).
execute_process(COMMAND "${TOOL}" reference RESULT_VARIABLE status OUTPUT_VARIABLE generated ERROR_VARIABLE err)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${TOOL} reference exited with ${status}:\n${err}")
endif()
if(NOT EXISTS "${REFERENCE}")
  message(FATAL_ERROR "${REFERENCE} does not exist; generate it:\n  ${TOOL} reference > ${REFERENCE}")
endif()
file(READ "${REFERENCE}" committed)
if(NOT committed STREQUAL generated)
  file(WRITE "${OUT}" "${generated}")
  message(FATAL_ERROR "${REFERENCE} is not what the schema gives (the schema changed?); the current "
                      "output is in ${OUT}. Regenerate it:\n  ${TOOL} reference > ${REFERENCE}")
endif()
message(STATUS "${REFERENCE} is current")
