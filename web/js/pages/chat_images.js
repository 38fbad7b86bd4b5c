// Images attached to the next chat message (file picker or paste), as data URLs: the
// OpenAI image_url parts a vision model takes. Only enabled for models with "vision".

import { h } from "../ui.js";

// The server's bounds (omlx/api/images.py): checked here first, so the mistake is named
// before anything is sent.
const MAX_IMAGES = 8;
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export function imageAttachments() {
  const pending = [];
  const strip = h("div.chat-attachments", { id: "chat-attachments", hidden: true });
  const notice = h("div.small.chat-attach-notice", { id: "chat-attach-notice", hidden: true });
  const picker = h("input", { type: "file", id: "chat-image-file", accept: "image/*", multiple: true, hidden: true });
  const button = h("button.btn", { id: "chat-attach", type: "button", title: "Attach images" }, "Image");
  let enabled = false;

  const say = (text) => {
    notice.textContent = text;
    notice.hidden = !text;
  };

  const redraw = () => {
    strip.replaceChildren(
      ...pending.map((url, i) =>
        h(
          "div.chat-thumb",
          { dataset: { index: String(i) } },
          h("img", { src: url, alt: `attached image ${i + 1}` }),
          h("button.btn.ghost.small", { type: "button", title: "Remove", dataset: { action: "remove-image" }, onclick: () => remove(i) }, "×"),
        ),
      ),
    );
    strip.hidden = pending.length === 0;
  };

  const remove = (i) => {
    pending.splice(i, 1);
    redraw();
  };

  async function add(files) {
    say("");
    for (const file of files) {
      if (!file.type.startsWith("image/")) continue;
      if (pending.length >= MAX_IMAGES) return say(`At most ${MAX_IMAGES} images per message.`);
      if (file.size > MAX_IMAGE_BYTES) {
        say(`${file.name || "The image"} is larger than 20 MiB; attach a smaller image.`);
        continue;
      }
      pending.push(await readAsDataUrl(file));
      redraw();
    }
  }

  button.onclick = () => picker.click();
  picker.onchange = async () => {
    await add([...picker.files]);
    picker.value = "";
  };

  return {
    elements: [picker, button],
    strip,
    notice,
    // Paste into the message box: images attach (vision models only), text pastes as usual.
    onPaste(event) {
      const files = [...(event.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
      if (!files.length) return;
      event.preventDefault();
      if (!enabled) return say("This model does not take images; pick one whose kind is vlm.");
      add(files);
    },
    setEnabled(on) {
      enabled = on;
      button.disabled = !on;
      button.title = on ? "Attach images" : "This model does not take images";
      if (!on) {
        pending.length = 0;
        redraw();
      }
      say("");
    },
    count: () => pending.length,
    // The attached images, handed over and cleared (the message carries them now).
    take() {
      const urls = pending.splice(0);
      redraw();
      return urls;
    },
  };
}

// A message's content: plain text, or image_url parts then the text when images are
// attached (the question after the pictures, as vision models are trained).
export function messageContent(text, urls) {
  if (!urls.length) return text;
  const images = urls.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? [...images, { type: "text", text }] : images;
}

export function thumbnails(urls) {
  return h("div.chat-images", urls.map((url, i) => h("img", { src: url, alt: `image ${i + 1}` })));
}
