// Parse an AsyncAPI document with the official parser (@asyncapi/parser, resolving its $refs to the
// JSON Schemas) and print one JSON object: {"valid", "diagnostics", "messages", "operations"}.
// "messages" maps each message name to its payload's required fields, so that a caller can check the
// parser saw the resolved schemas, with the message's examples. Exit status 0 when the parser produced a document, 1 otherwise.
//   node protocol/validate.mjs protocol/asyncapi.yaml
import { Parser, fromFile } from '@asyncapi/parser';

const SEVERITY = ['error', 'warning', 'info', 'hint'];
const path = process.argv[2] ?? new URL('asyncapi.yaml', import.meta.url).pathname;
const { document, diagnostics } = await fromFile(new Parser(), path).parse();
const report = {
  valid: Boolean(document),
  diagnostics: diagnostics.map((d) => ({
    severity: SEVERITY[d.severity] ?? String(d.severity),
    code: d.code,
    path: d.path.join('/'),
    message: d.message,
  })),
  messages: {},
  operations: {},
};
if (document) {
  for (const message of document.messages()) {
    report.messages[message.name()] = {
      required: message.payload()?.required() ?? null,
      examples: message.examples().all().map((example) => example.payload()),
    };
  }
  for (const operation of document.operations()) {
    report.operations[operation.id()] = {
      action: operation.action(),
      messages: operation.messages().all().map((m) => m.name()),
      reply: operation.reply()?.messages().all().map((m) => m.name()) ?? [],
      channels: operation.channels().all().map((c) => c.address()),
    };
  }
}
console.log(JSON.stringify(report));
process.exitCode = document ? 0 : 1;
